"""Google Cloud Storage backend (``gs://bucket/prefix``) on aiohttp and the JSON API.

Why aiohttp directly, and not gcsfs or tensorstore's kvstore (measured): see
:mod:`ckptio.backends._gcs_http`, whose HTTP mechanics are the reason.

Protocol
--------
* Objects up to ``resumable_threshold`` go up in one request; bigger ones in
  a resumable upload of ``chunk_size`` chunks (a multiple of 256 KiB).
* Every upload is *confirmed*: the object resource GCS answers with carries
  the CRC32C and size the server computed over the bytes it stored, and they
  must equal ours, else the write raises RetryableError (bytes damaged on the
  way; the engine uploads again, over the damaged object) -- so damage in
  transit is caught while the save can still repair it, not at restore, on
  every upload type and on servers that check nothing (the emulator). On top
  of that the CRC32C is declared to the server where the JSON API documents
  it (multipart metadata; resumable metadata and ``x-goog-hash`` on the last
  chunk), so real GCS refuses such an upload before it replaces anything.
* The one-request type is ``GCSConfig.upload`` = ``"media"`` (default): the
  bytes are the whole body, the CRC32C rides in ``x-goog-hash`` and in the
  confirmation. ``"multipart"`` sends JSON metadata with the CRC32C first.
  Measured against fake-gcs-server (1 GiB as 8 or 16 objects at once, 2
  rounds, GiB/s): media 0.28-0.31, multipart 0.17-0.22, a resumable upload
  in one chunk 0.17-0.18 -- the emulator copies multipart and resumable
  bodies several times. The commit marker is always multipart (below).
  Verification on read is the engine's job (manifest checksums).
* A failed resumable chunk is resumed here (the one retry inside a backend):
  the upload's status is queried and sending continues from the persisted
  offset. Not against the emulator: its status query *finalises* the object
  and it appends a re-sent chunk blindly, so there a failed chunk raises
  RetryableError and the engine restarts the whole upload.
* Parallel composite upload (parts + compose) is not used: with objects of
  ~64 MiB and 32 requests in flight the connection count, not per-object
  parallelism, limits throughput, and on 2 cores the extra requests and the
  compose cost more than they gain.
  Measured: one 256 MiB object as a single multipart request 150-256
  MiB/s, as 4 parallel parts + compose + deleting the parts 100-106 MiB/s.
* Ranged reads send ``ByteRange.http_header()`` and stream the body into the
  destination buffers; ``Content-Range``'s total detects a range past the end.
  A whole small object (``read``: manifests, fences, fragments) is one GET.
* ``create_if_absent`` is a multipart upload with ``ifGenerationMatch=0``
  (the emulator honours preconditions only on multipart uploads).
* ``delete_if`` is a DELETE with ``ifGenerationMatch`` (the generation a stat or listing named);
  412 there means another generation stands: False. The emulator ignores preconditions on DELETE
  (tests put :class:`PreconditionProxy` of tests/support/fake_gcs.py in front of it).
* Errors: 404 FileNotFoundError, 412 FileExistsError, 401/403
  PermissionError, 408/429/5xx, resets, timeouts and truncated bodies
  RetryableError (with ``Retry-After``); see :func:`._gcs_http.raise_for_status`.
* Credentials: google-auth's application defaults (refreshed in a thread);
  anonymous against an emulator (``STORAGE_EMULATOR_HOST``, or an explicit
  ``endpoint`` that is not ``*.googleapis.com``).
* A request-rate ramp (token bucket doubling every 20 min) keeps a fresh
  bucket from thousands of writes in its first second; on for real GCS, off
  for the emulator. It is per process: with many hosts, lower
  ``RampConfig.initial_writes_per_s`` to the host's share.
* Sessions are bound to an event loop, so there is one per loop, made on
  first use (the engine's loop thread, Orbax's per-commit loops, tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
from yarl import URL

from ckptio.backends._gcs_config import GCSConfig, RampConfig, resolve_endpoint
from ckptio.backends._gcs_http import (
    BuffersPayload, Damaged, RateRamp, SessionGone, TokenSource, confirmation, crc32c_b64, drain,
    fill_from_response, parse_rfc3339, persisted_offset, raise_for_status, read_json, session_pool,
    slice_views, translating, whole_body,
)
from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, LayoutDefaults, ObjectInfo, RetryableError, check_fill, check_key,
    check_prefix,
)
from ckptio.backends.budget import each_request
from ckptio.system.bytes import byte_views

__all__ = ["GCSBackend", "GCSConfig", "RampConfig"]  # the configs live in _gcs_config

T = TypeVar("T")

#: What an upload's reply must carry to confirm it (real GCS sends only the fields asked for).
_CONFIRM_FIELDS = "generation,crc32c,size"


class GCSBackend(Backend):
    """Objects of one bucket under a prefix; keys are names relative to the prefix."""

    def __init__(self, url: str = "", config: GCSConfig | None = None, **options: Any) -> None:
        if isinstance(options.get("ramp"), dict):
            options["ramp"] = RampConfig(**options["ramp"])
        self.config = dataclasses.replace(config or GCSConfig(), **options)
        if not url.startswith("gs://"):
            raise ValueError(f"GCS backend URL must look like gs://bucket/prefix, got {url!r}")
        bucket, _, prefix = url[len("gs://") :].partition("/")
        if not bucket:
            raise ValueError(f"GCS URL {url!r} names no bucket")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._name_prefix = self.prefix + "/" if self.prefix else ""
        self._url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        self.endpoint, self.emulated = resolve_endpoint(self.config)
        cfg = self.config
        self._auth = TokenSource(self.emulated if cfg.anonymous is None else cfg.anonymous)
        self._resume = (not self.emulated) if cfg.resume_chunks is None else cfg.resume_chunks
        ramp_on = (not self.emulated) if cfg.ramp.enabled is None else cfg.ramp.enabled
        self._write_ramp = self._read_ramp = None
        if ramp_on:
            r = cfg.ramp
            self._write_ramp = RateRamp(r.initial_writes_per_s, r.doubling_s, r.max_per_s)
            self._read_ramp = RateRamp(r.initial_reads_per_s, r.doubling_s, r.max_per_s)
        self._sessions = session_pool(self._new_session)
        self._b = quote(bucket, safe="")
        self.capabilities = Capabilities(
            atomic_write=True,
            conditional_create=True,
            durable_on_close=True,
            preferred_io_size=16 << 20,
            concurrency=cfg.concurrency,
            list_consistent=True,
            conditional_delete=True,  # DELETE with ifGenerationMatch
        )
        self.layout_defaults = LayoutDefaults(
            object_size=cfg.object_size,
            hashed_names=True,
            tile_bytes=1 << 20,  # every host restores its own part of a shared checkpoint
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Sessions and tokens do not travel: another process rebuilds them from URL and config.
        return (type(self), (self._url, self.config))

    @property
    def url(self) -> str:
        return self._url

    def _new_session(self) -> aiohttp.ClientSession:
        connect, read = self.config.timeouts
        return aiohttp.ClientSession(
            # More connections than requests in flight: a resumable upload briefly holds two.
            connector=aiohttp.TCPConnector(limit=2 * self.config.concurrency, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(total=None, connect=connect, sock_read=read),
            auto_decompress=False,  # bytes go to the caller's buffers exactly as stored
            headers={"User-Agent": "ckptio"},
        )

    # -- names and URLs ----------------------------------------------------

    def _name(self, key: str) -> str:
        return self._name_prefix + check_key(key)

    def _api_url(self, path: str, query: dict[str, Any]) -> URL:
        qs = "?" + urlencode(query, quote_via=quote) if query else ""
        # encoded=True: an object name's %2F must reach the server as is, not be re-quoted by yarl.
        return URL(f"{self.endpoint}{path}{qs}", encoded=True)

    def _object_url(self, name: str, **query: Any) -> URL:
        return self._api_url(f"/storage/v1/b/{self._b}/o/{quote(name, safe='')}", query)

    def _upload_url(self, **query: Any) -> URL:
        return self._api_url(f"/upload/storage/v1/b/{self._b}/o", query)

    # -- the one request path ------------------------------------------------

    async def _call(
        self,
        method: str,
        url: URL,
        what: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        ok: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
        data: Any = None,
        ramp: RateRamp | None = None,
        session: bool = False,
    ) -> T:
        """Send one request; ``handle`` reads a success, anything else is translated and raised.

        ``session``: the URL is a resumable upload session, whose 404/410 means
        it expired -- a reason to start the upload again, not a missing object.
        """
        async with translating(what):
            await each_request(method)  # every request, page and chunk counts against a request budget
            if ramp is not None:  # first: a token fetched before a long wait could go stale
                await ramp.acquire()
            client = await self._sessions.get()
            all_headers = await self._auth.headers()
            if headers:
                all_headers.update(headers)
            request = client.request(method, url, headers=all_headers, data=data, allow_redirects=False)
            async with request as resp:
                if resp.status not in ok:
                    if session and resp.status in (404, 410):
                        raise SessionGone(f"{what}: HTTP {resp.status}: the upload session is gone")
                    if resp.status == 401:
                        self._auth.invalidate()
                    if resp.status == 416 and self.emulated:
                        # fake-gcs-server closes the connection after a 416 without saying so,
                        # once aiohttp has pooled it again: let the close land before the next request.
                        await asyncio.sleep(0.01)
                    await raise_for_status(resp, what)
                return await handle(resp)
        raise AssertionError("unreachable")  # translating() re-raises; keeps type checkers content

    # -- writing ---------------------------------------------------------------

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        name = self._name(key)
        views = byte_views(buffers)
        size = sum(v.nbytes for v in views)
        crc = await crc32c_b64(views)
        what = f"{self._url}: writing {key!r}"
        if size > self.config.resumable_threshold:
            await self._resumable_upload(name, views, size, crc, what=f"{what} (resumable)")
        elif self.config.upload == "media":
            await self._media_upload(name, views, size, crc, what=what)
        else:
            await self._multipart_upload(name, views, size, crc, what=what)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        name = self._name(key)
        views = byte_views([data])
        crc = await crc32c_b64(views)
        what = f"{self._url}: creating {key!r}"
        try:
            await self._multipart_upload(name, views, len(data), crc, what=what, if_generation_match=0)
        except Damaged as e:
            # Created, but not with our bytes (only a server that checks nothing lets that
            # happen): uploading again would meet 412, and readers refuse the damaged marker
            # anyway (it is sealed by its own checksum). Say so rather than retry.
            raise OSError(f"{e}; the object now exists damaged: delete it before committing again") from e

    async def _media_upload(
        self, name: str, views: Sequence[memoryview], size: int, crc: str, *, what: str
    ) -> None:
        """One request whose body is the bytes; the CRC32C in ``x-goog-hash`` and checked in the reply."""
        body = BuffersPayload(views, content_type="application/octet-stream")
        url = self._upload_url(uploadType="media", name=name, fields=_CONFIRM_FIELDS)
        headers = {"x-goog-hash": f"crc32c={crc}"}
        confirm = confirmation(size, crc, what)
        await self._call("POST", url, what, confirm, data=body, headers=headers, ramp=self._write_ramp)

    async def _multipart_upload(
        self,
        name: str,
        views: Sequence[memoryview],
        size: int,
        crc: str,
        *,
        what: str,
        if_generation_match: int | None = None,
    ) -> None:
        """One request: JSON metadata (name, CRC32C) then the bytes, as multipart/related."""
        boundary = "ckptio-" + uuid.uuid4().hex
        meta = json.dumps({"name": name, "crc32c": crc}).encode()
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode()
            + meta
            + f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
        )
        tail = f"\r\n--{boundary}--\r\n".encode()
        body = BuffersPayload([head, *views, tail], content_type=f"multipart/related; boundary={boundary}")
        query: dict[str, Any] = {"uploadType": "multipart", "fields": _CONFIRM_FIELDS}
        if if_generation_match is not None:
            query["ifGenerationMatch"] = if_generation_match
        url = self._upload_url(**query)
        confirm = confirmation(size, crc, what)
        await self._call("POST", url, what, confirm, data=body, ramp=self._write_ramp)

    async def _resumable_upload(
        self, name: str, views: Sequence[memoryview], size: int, crc: str, *, what: str
    ) -> None:
        """Start a resumable session, then send ``chunk_size`` chunks; resume a failed one if allowed."""

        async def location(resp: aiohttp.ClientResponse) -> str:
            await resp.read()
            loc = resp.headers.get("Location")
            if not loc:
                raise RetryableError(f"{what}: no upload session URL in the response")
            return loc

        session_url = await self._call(
            "POST",
            self._upload_url(uploadType="resumable"),
            what,
            location,
            data=json.dumps({"name": name, "crc32c": crc}).encode(),
            headers={
                "Content-Type": "application/json; charset=UTF-8",
                "X-Upload-Content-Type": "application/octet-stream",
                "X-Upload-Content-Length": str(size),
            },
            ramp=self._write_ramp,
        )
        upload = URL(session_url, encoded=True)
        # Whichever reply finishes the upload (last chunk, or a status query after a lost
        # reply) carries the object resource; it is confirmed like a one-request upload.
        persisted = functools.partial(persisted_offset, size=size, confirm=confirmation(size, crc, what))
        offset = 0
        while offset < size:
            end = min(offset + self.config.chunk_size, size)
            try:
                final_crc = crc if end == size else None
                offset = await self._put_chunk(upload, views, offset, end, size, final_crc, what, persisted)
            except (SessionGone, Damaged):
                raise  # only a new upload helps: the engine's retry starts one
            except RetryableError:
                if not self._resume:
                    raise
                offset = await self._recover_offset(upload, size, what, persisted)

    async def _recover_offset(
        self, upload: URL, size: int, what: str, persisted: Callable[[aiohttp.ClientResponse], Awaitable[int]]
    ) -> int:
        """After a failed chunk, ask the session how much it holds (a few tries, with backoff)."""
        for attempt in range(1, 5):
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0) * (0.5 + random.random()))
            try:
                return await self._query_offset(upload, size, what, persisted)
            except (SessionGone, Damaged):
                raise
            except RetryableError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    async def _put_chunk(
        self,
        upload: URL,
        views: Sequence[memoryview],
        start: int,
        end: int,
        size: int,
        crc: str | None,
        what: str,
        persisted: Callable[[aiohttp.ClientResponse], Awaitable[int]],
    ) -> int:
        """Send bytes ``[start, end)``; return the offset GCS has persisted up to."""
        total = str(size) if end == size else "*"  # "*": more chunks follow
        headers = {"Content-Range": f"bytes {start}-{end - 1}/{total}"}
        if crc is not None:
            headers["x-goog-hash"] = f"crc32c={crc}"
        body = BuffersPayload(slice_views(views, start, end), content_type="application/octet-stream")
        return await self._call(
            "PUT", upload, what, persisted, ok=(200, 201, 308), headers=headers, data=body, session=True
        )

    async def _query_offset(
        self, upload: URL, size: int, what: str, persisted: Callable[[aiohttp.ClientResponse], Awaitable[int]]
    ) -> int:
        """Ask a resumable session how many bytes it holds (real GCS only: the emulator finalises)."""
        return await self._call(
            "PUT",
            upload,
            f"{what} status",
            persisted,
            ok=(200, 201, 308),
            headers={"Content-Range": f"bytes */{size}"},
            session=True,
        )

    # -- reading -----------------------------------------------------------------

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        name = self._name(key)
        views = byte_views(buffers)  # no empty views: they would stall the fill loop
        check_fill(rng, views)
        what = f"{self._url}: reading {key!r} [{rng.start}, {rng.end})"
        if rng.length == 0:  # an HTTP range cannot be empty
            return await self.check_empty_read(key, rng, what)

        async def fill(resp: aiohttp.ClientResponse) -> None:
            await fill_from_response(resp, rng, views, what)

        await self._call(
            "GET",
            self._object_url(name, alt="media"),
            what,
            fill,
            ok=(200, 206),
            headers={"Range": rng.http_header(), "Accept-Encoding": "identity"},
            ramp=self._read_ramp,
        )

    async def read(self, key: str) -> bytes:
        what = f"{self._url}: reading {key!r}"  # one GET: not a stat, then a ranged read (two slots)
        return await self._call("GET", self._object_url(self._name(key), alt="media"), what, whole_body(what),
                                headers={"Accept-Encoding": "identity"}, ramp=self._read_ramp)

    # -- metadata -------------------------------------------------------------------

    async def stat(self, key: str) -> ObjectInfo:
        name = self._name(key)
        doc = await self._call(
            "GET",
            self._object_url(name, fields="name,size,updated,generation"),
            f"{self._url}: stat of {key!r}",
            read_json,
            ramp=self._read_ramp,
        )
        generation = str(doc.get("generation", ""))  # "" (no delete_if) if a server leaves it out
        return ObjectInfo(key, int(doc["size"]), parse_rfc3339(doc["updated"]), generation)

    async def delete(self, key: str) -> None:
        name = self._name(key)
        await self._call(
            "DELETE",
            self._object_url(name),
            f"{self._url}: deleting {key!r}",
            drain,
            ok=(200, 204),
            ramp=self._write_ramp,
        )

    async def delete_if(self, key: str, version: str) -> bool:
        if not version.isdigit():
            raise ValueError(f"{self._url}: {version!r} is no GCS generation (delete_if of {key!r})")

        async def deleted(resp: aiohttp.ClientResponse) -> bool:
            await drain(resp)
            return resp.status != 412  # another generation stands: nothing was deleted

        url = self._object_url(self._name(key), ifGenerationMatch=version)
        what = f"{self._url}: deleting {key!r} if unchanged"
        return await self._call("DELETE", url, what, deleted, ok=(200, 204, 412), ramp=self._write_ramp)

    async def _list_pages(self, prefix: str, delimiter: bool) -> tuple[list[dict[str, Any]], list[str]]:
        """Every item and sub-prefix under ``prefix`` (a full object-name prefix), page by page."""
        items: list[dict[str, Any]] = []
        prefixes: list[str] = []
        query: dict[str, Any] = {
            "prefix": prefix,
            "maxResults": self.config.list_page_size,
            "fields": "items(name,size,updated,generation),prefixes,nextPageToken",
        }
        if delimiter:
            query["delimiter"] = "/"
        what = f"{self._url}: listing {prefix!r}"
        while True:
            url = self._api_url(f"/storage/v1/b/{self._b}/o", query)
            doc = await self._call("GET", url, what, read_json, ramp=self._read_ramp)
            items.extend(doc.get("items", ()))
            prefixes.extend(doc.get("prefixes", ()))
            token = doc.get("nextPageToken")
            if not token:
                return items, prefixes
            query["pageToken"] = token

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        items, _ = await self._list_pages(self._name_prefix + check_prefix(prefix), delimiter=False)
        cut = len(self._name_prefix)
        out = [
            ObjectInfo(item["name"][cut:], int(item["size"]), parse_rfc3339(item["updated"]),
                       str(item.get("generation", "")))
            for item in items
            if item["name"][cut:]  # an object named exactly "prefix/" is no key
        ]
        out.sort(key=lambda i: i.key)
        return out

    async def list_children(self, prefix: str = "") -> list[str]:
        # Trailing slashes are forgiven ("a/" is "a"); the rest is checked like a listing prefix.
        rel = check_prefix(prefix.rstrip("/") + "/") if prefix else ""
        base = self._name_prefix + rel
        items, prefixes = await self._list_pages(base, delimiter=True)
        names = {item["name"][len(base) :] for item in items}
        names.update(p[len(base) :].rstrip("/") for p in prefixes)
        names.discard("")
        return sorted(names)

    # -- lifetime --------------------------------------------------------------------

    async def close_loop(self) -> None:
        """Close only the running loop's session (before closing a short-lived loop).

        The backend stays usable: the next call makes a new session.
        """
        await self._sessions.close_current()

    async def close(self) -> None:
        """Close every loop's session. The backend stays usable (sessions are remade lazily)."""
        await self._sessions.close_all()

