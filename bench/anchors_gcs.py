"""The GCS ceiling: plain aiohttp against the same endpoint, no library in the way.

``raw-aiohttp`` is what any client could reach against this endpoint (the
fake-gcs-server the bench started, an emulator, or real GCS): the state's
arrays packed into 8 objects of equal size, all 8 sent at once as one-shot
media uploads (``POST /upload/storage/v1/b/B/o?uploadType=media``, the
arrays streamed back to back from their own memory, never joined), and read
back by 8 concurrent ``GET …?alt=media`` whose bodies are copied straight
into freshly allocated arrays. No checksums, no manifest, no retries, no
commit: a ceiling, not a format. ckptio's figures on ``gs://`` are read as
ratios of it, measured in the same run against the same kind of server.

``raw-aiohttp-multipart`` is the same with ``uploadType=multipart`` (a JSON
metadata part, then the bytes), the request ckptio's backend sends so that
the CRC32C travels in the metadata (and the commit can carry
``ifGenerationMatch=0``, which the emulator honours only there). On real
GCS both upload types cost the same; fake-gcs-server parses a multipart body
markedly slower than a media body, so on the emulator this second reference
separates what the upload type costs from what ckptio itself adds.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from ckptio.bench.cases import Case, Pending, register

__all__ = ["RawAiohttp", "RawAiohttpMultipart", "gcs_endpoint"]

_SLICE = 1 << 20  # bytes per socket write: bounds the transport's copy and lets drain() pace us


def gcs_endpoint() -> tuple[str, bool]:
    """``(endpoint, is an emulator)`` from ``STORAGE_EMULATOR_HOST``, exactly as the ckptio backend resolves it."""
    from ckptio.backends._gcs_config import GCSConfig, resolve_endpoint  # no aiohttp import

    return resolve_endpoint(GCSConfig())


def _bytes_view(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def _payload(views: Sequence[memoryview], content_type: str = "application/octet-stream") -> Any:
    """A request body of several buffers, in order, with a Content-Length, never concatenated."""
    import aiohttp

    class _Views(aiohttp.payload.Payload):
        _autoclose = True

        def __init__(self) -> None:
            super().__init__(views, content_type=content_type)
            self._size = sum(v.nbytes for v in views)

        def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:  # pragma: no cover
            return b"".join(views).decode(encoding, errors)

        async def write(self, writer: Any) -> None:
            for v in views:
                for off in range(0, v.nbytes, _SLICE):
                    await writer.write(v[off : off + _SLICE])

    return _Views()


@register
class RawAiohttp(Case):
    """8 concurrent objects: one-shot media upload, GET into fresh buffers; no checksums, no commit."""

    name = "raw-aiohttp"
    kind = "anchor"
    framework = "numpy"
    requires = ("aiohttp",)
    schemes = frozenset({"gs"})
    streams = 8
    upload = "media"
    description = "8 objects at once by plain aiohttp: media upload from the arrays, GET alt=media into fresh arrays"
    durability = "each upload acknowledged (200) by the server; no checksum, no manifest"

    def setup(self) -> None:
        import aiohttp

        rest = self.ctx.root.split("://", 1)[1]
        self._bucket, _, prefix = rest.partition("/")
        self._prefix = prefix.strip("/")
        self._endpoint, emulated = gcs_endpoint()
        self._auth: Any = None
        if not emulated:
            from ckptio.backends._gcs_http import TokenSource  # google-auth defaults; not on the data path

            self._auth = TokenSource(anonymous=False)
        # Balance bytes over the objects (largest first onto the lightest), as raw-disk does with files.
        n = max(1, min(self.streams, len(self.state)))
        self._plan: list[list[str]] = [[] for _ in range(n)]
        loads = [0] * n
        for name, arr in sorted(self.state.items(), key=lambda kv: -kv[1].nbytes):
            i = loads.index(min(loads))
            self._plan[i].append(name)
            loads[i] += arr.nbytes
        self._loop = asyncio.new_event_loop()
        self._session = self._loop.run_until_complete(self._open(aiohttp))

    async def _open(self, aiohttp: Any) -> Any:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=2 * self.streams),
            timeout=aiohttp.ClientTimeout(total=None, connect=30, sock_read=300),
            auto_decompress=False,
        )

    def _name(self, step: int, i: int) -> str:
        return "/".join(p for p in (self._prefix, f"step_{step}", f"obj-{self.ctx.rank}-{i}") if p)

    async def _headers(self) -> dict[str, str]:
        return await self._auth.headers() if self._auth is not None else {}

    async def _put(self, step: int, i: int) -> None:
        views = [_bytes_view(self.state[k]) for k in self._plan[i] if self.state[k].nbytes]
        name = self._name(step, i)
        base = f"{self._endpoint}/upload/storage/v1/b/{quote(self._bucket, safe='')}/o"
        if self.upload == "media":
            url = f"{base}?uploadType=media&name={quote(name, safe='')}"
            body = _payload(views)
        else:
            boundary = "raw-" + uuid.uuid4().hex
            head = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                    + json.dumps({"name": name})
                    + f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
            tail = f"\r\n--{boundary}--\r\n".encode()
            url = f"{base}?uploadType=multipart"
            body = _payload([memoryview(head), *views, memoryview(tail)],
                            content_type=f"multipart/related; boundary={boundary}")
        async with self._session.post(url, data=body, headers=await self._headers()) as r:
            body = await r.read()
            if r.status != 200:
                raise OSError(f"upload {self._name(step, i)}: HTTP {r.status} {body[:300]!r}")

    async def _get(self, step: int, i: int) -> dict[str, np.ndarray]:
        out = {k: np.empty(self.state[k].shape, self.state[k].dtype) for k in self._plan[i]}
        dests = [_bytes_view(a) for a in out.values() if a.nbytes]
        url = (f"{self._endpoint}/storage/v1/b/{quote(self._bucket, safe='')}/o/"
               f"{quote(self._name(step, i), safe='')}?alt=media")
        headers = {**await self._headers(), "Accept-Encoding": "identity"}
        async with self._session.get(url, headers=headers) as r:
            if r.status != 200:
                raise OSError(f"download {self._name(step, i)}: HTTP {r.status} {(await r.read())[:300]!r}")
            di, pos = 0, 0
            async for chunk in r.content.iter_any():
                data = memoryview(chunk)
                while data:
                    if di == len(dests):
                        raise OSError(f"download {self._name(step, i)}: longer than what was uploaded")
                    dst = dests[di]
                    n = min(dst.nbytes - pos, len(data))
                    dst[pos : pos + n] = data[:n]
                    data, pos = data[n:], pos + n
                    if pos == dst.nbytes:
                        di, pos = di + 1, 0
            if di != len(dests):
                raise OSError(f"download {self._name(step, i)}: shorter than what was uploaded")
        return out

    def save(self, step: int) -> Pending | None:
        async def all_puts() -> None:
            await asyncio.gather(*(self._put(step, i) for i in range(len(self._plan))))

        self._loop.run_until_complete(all_puts())
        return None

    def restore(self, step: int) -> Mapping[str, Any]:
        async def all_gets() -> list[dict[str, np.ndarray]]:
            return await asyncio.gather(*(self._get(step, i) for i in range(len(self._plan))))

        out: dict[str, np.ndarray] = {}
        for part in self._loop.run_until_complete(all_gets()):
            out.update(part)
        return out

    def step_path(self, step: int) -> str | None:
        return None  # an object store: no local files to drop from the page cache

    def info(self) -> dict[str, Any]:
        sizes = [sum(self.state[k].nbytes for k in names) for names in self._plan]
        return {"objects": len(self._plan), "object_bytes": sizes, "endpoint": self._endpoint}

    def close(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is None:
            return
        loop.run_until_complete(self._session.close())
        loop.close()


@register
class RawAiohttpMultipart(RawAiohttp):
    """The same with multipart uploads (metadata part + bytes): the request type ckptio sends."""

    name = "raw-aiohttp-multipart"
    upload = "multipart"
    description = "as raw-aiohttp, but uploadType=multipart (JSON metadata + bytes), the request ckptio sends"
