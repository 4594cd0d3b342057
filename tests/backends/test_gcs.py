"""GCSBackend against fake-gcs-server: the shared conformance suite plus GCS-specific tests.

The server is module-scoped (``fake_gcs`` in conftest); each test uses its own
prefix of the one bucket. Tests of behaviour the emulator cannot show
(fixed error statuses, a resumable session that persists part of a chunk)
use small in-test servers (:class:`fake_gcs.AppServer`).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import pickle
import random
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import pytest
from aiohttp import web
from tests.conftest import GCS_TEST_BUCKET
from fake_gcs import AppServer, FakeGCS, FaultProxy, free_port, unique_prefix

from ckptio.backends import ByteRange, RetryableError, open_backend
from ckptio.backends._gcs_http import RateRamp, parse_retry_after, parse_rfc3339
from ckptio.backends.gcs import GCSBackend, GCSConfig, RampConfig
from ckptio.testing import BackendConformance, split_views

pytestmark = pytest.mark.gcs
T = TypeVar("T")


def gcs_url(tmp_path: Path) -> str:
    """A prefix of the module's bucket that no other test uses."""
    return f"gs://{GCS_TEST_BUCKET}/{unique_prefix(tmp_path)}"


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


# -- the shared suite ----------------------------------------------------------------


class TestGCSBackend(BackendConformance):
    @pytest.fixture(autouse=True)
    def _gcs_server(self, fake_gcs: FakeGCS, request: pytest.FixtureRequest) -> None:
        self.server = fake_gcs
        # The emulator ignores preconditions on DELETE: the conditional-delete checks go through a
        # proxy that enforces them, as GCS does (the rest talks to the emulator directly).
        conditional = "delete_if" in request.node.name
        self.endpoint = request.getfixturevalue("gcs_preconditions") if conditional else fake_gcs.url

    def make_backend(self, tmp_path: Path) -> GCSBackend:
        return GCSBackend(gcs_url(tmp_path), endpoint=self.endpoint)


class TestGCSBackendResumable(TestGCSBackend):
    """The suite again with every object above 256 KiB sent as a resumable upload of 256 KiB chunks."""

    state_machine_examples = 10

    def make_backend(self, tmp_path: Path) -> GCSBackend:
        return GCSBackend(
            gcs_url(tmp_path), endpoint=self.endpoint, resumable_threshold=256 << 10, chunk_size=256 << 10
        )


class TestGCSBackendMultipart(TestGCSBackend):
    """The suite again with one-request uploads as multipart (metadata + bytes) instead of media."""

    state_machine_examples = 10

    def make_backend(self, tmp_path: Path) -> GCSBackend:
        return GCSBackend(gcs_url(tmp_path), endpoint=self.endpoint, upload="multipart")


# -- configuration, endpoints, credentials ----------------------------------------------


def test_url_config_and_endpoint_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    real = GCSBackend("gs://bucket/some/prefix/")
    assert (real.url, real.bucket, real.prefix) == ("gs://bucket/some/prefix", "bucket", "some/prefix")
    assert real.endpoint == "https://storage.googleapis.com" and not real.emulated
    assert not real._auth.anonymous and real._write_ramp is not None and real._resume
    caps, layout = real.capabilities, real.layout_defaults
    assert caps.conditional_create and caps.list_consistent and caps.atomic_write and layout.hashed_names
    assert layout.object_size == 64 << 20 and caps.concurrency == 32
    assert GCSBackend("gs://bucket").url == "gs://bucket"

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")  # the scheme-less form gcloud uses
    emu = open_backend("gs://bucket/p")
    assert isinstance(emu, GCSBackend)
    assert emu.endpoint == "http://127.0.0.1:4443" and emu.emulated and emu._auth.anonymous
    assert emu._write_ramp is None and not emu._resume
    # Explicit options win over the environment; a private googleapis.com endpoint is real GCS.
    no_ramp = RampConfig(enabled=False)
    psc = GCSBackend("gs://b", endpoint="https://storage-abc.p.googleapis.com", ramp=no_ramp)
    assert not psc.emulated and not psc._auth.anonymous and psc._write_ramp is None
    custom = GCSBackend("gs://b", GCSConfig(chunk_size=512 << 10), concurrency=4, ramp={"enabled": True})
    assert custom.config.chunk_size == 512 << 10 and custom.capabilities.concurrency == 4
    assert custom._write_ramp is not None

    for bad in ("s3://bucket", "gs://", "gs:///prefix"):
        with pytest.raises(ValueError):
            GCSBackend(bad)
    with pytest.raises(ValueError):
        GCSConfig(chunk_size=1000)  # not a multiple of 256 KiB

    clone = pickle.loads(pickle.dumps(custom))
    assert isinstance(clone, GCSBackend) and clone.url == custom.url and clone.config == custom.config


class _Recorder(AppServer):
    """Answers every request with ``status`` (and ``headers``, ``body``), recording what it got."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None, body: bytes = b"{}") -> None:
        super().__init__()
        self.status, self.headers, self.body = status, headers or {}, body
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.append((request.method, request.raw_path, dict(request.headers)))
        return web.Response(status=self.status, headers=self.headers, body=self.body)


class _FakeCredentials:
    """Stands in for google-auth credentials: invalid until refreshed."""

    def __init__(self) -> None:
        self.refreshes = 0
        self.token: str | None = None

    @property
    def valid(self) -> bool:
        return self.token is not None

    def refresh(self, request: Any) -> None:
        self.refreshes += 1
        self.token = f"token-{self.refreshes}"

    def apply(self, headers: dict[str, str]) -> None:
        headers["authorization"] = f"Bearer {self.token}"


def test_credentials_from_google_auth_refreshed_once_and_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    import google.auth

    creds = _FakeCredentials()
    calls: list[Any] = []

    def fake_default(scopes: Any = None, **kw: Any) -> tuple[Any, str]:
        calls.append(scopes)
        return creds, "project"

    monkeypatch.setattr(google.auth, "default", fake_default)
    doc = json.dumps({"name": "p/k", "size": "3", "updated": "2024-05-01T12:00:00.5Z"}).encode()
    with _Recorder(200, body=doc) as server:
        b = GCSBackend("gs://bkt/p", endpoint=server.url, anonymous=False)

        async def body() -> None:
            infos = await asyncio.gather(*(b.stat("k") for _ in range(8)))
            assert {(i.key, i.size) for i in infos} == {("k", 3)}
            await b.close()

        run(body)
    assert len(calls) == 1 and "devstorage.read_write" in calls[0][0]
    assert creds.refreshes == 1  # eight concurrent requests, one refresh
    assert {h.get("Authorization") for _, _, h in server.seen} == {"Bearer token-1"}
    # Anonymous (the emulator): no header at all.
    with _Recorder(200, body=doc) as server:
        b = GCSBackend("gs://bkt/p", endpoint=server.url)
        run(lambda: b.stat("k"))
        assert "Authorization" not in server.seen[0][2]


# -- error translation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "body", "exc", "retry_after"),
    [
        (404, {}, b'{"error": {"code": 404, "message": "No such object"}}', FileNotFoundError, None),
        (412, {}, b"", FileExistsError, None),
        (401, {}, b"", PermissionError, None),
        (403, {}, b'{"error": {"message": "no storage.objects.get access"}}', PermissionError, None),
        (416, {}, b"", ValueError, None),
        (400, {}, b'{"error": {"message": "Invalid argument"}}', ValueError, None),
        (400, {}, b'{"error": {"message": "Provided CRC32C does not match"}}', RetryableError, None),
        (408, {}, b"", RetryableError, None),
        (429, {"Retry-After": "7"}, b"", RetryableError, 7.0),
        (500, {}, b"", RetryableError, None),
        (502, {}, b"", RetryableError, None),
        (503, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, b"", RetryableError, 0.0),
    ],
)
def test_statuses_translate_to_builtins(
    status: int, headers: dict[str, str], body: bytes, exc: type[Exception], retry_after: float | None
) -> None:
    with _Recorder(status, headers, body) as server:
        b = GCSBackend("gs://bkt/p", endpoint=server.url)
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: b.stat("k"),
            lambda: b.read_into("k", ByteRange(0, 4), [memoryview(bytearray(4))]),
            lambda: b.write("k", [memoryview(b"data")]),
            lambda: b.create_if_absent("k", b"data"),
            lambda: b.delete("k"),
            lambda: b.list("x"),
        ]

        async def body_() -> None:
            for call in calls:
                with pytest.raises(exc) as info:
                    await call()
                assert f"HTTP {status}" in str(info.value)
                if exc is RetryableError:
                    assert info.value.retry_after == retry_after  # type: ignore[attr-defined]
            await b.close()

        run(body_)


def test_transport_failures_are_retryable(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    async def body() -> None:
        # Nothing listens: connection refused.
        dead = GCSBackend("gs://bkt/p", endpoint=f"http://127.0.0.1:{free_port()}")
        with pytest.raises(RetryableError, match="ClientConnectorError|ClientOSError"):
            await dead.stat("k")
        await dead.close()
        # A response slower than the read timeout.
        with FaultProxy(fake_gcs.url, rate=1.0, kinds=("slow",), slow_s=1.0) as proxy:
            slow = GCSBackend(gcs_url(tmp_path), endpoint=proxy.url, timeouts=(5.0, 0.2))
            with pytest.raises(RetryableError, match="[Tt]imeout"):
                await slow.list()
            await slow.close()
        # A download cut off halfway, and an upload whose answer never comes.
        good = GCSBackend(gcs_url(tmp_path), endpoint=fake_gcs.url)
        await good.write("obj", [memoryview(payload(100_000))])
        with FaultProxy(fake_gcs.url, rate=1.0, kinds=("reset",)) as proxy:
            cut = GCSBackend(gcs_url(tmp_path), endpoint=proxy.url)
            with pytest.raises(RetryableError, match="[Pp]ayload"):
                await cut.read_into("obj", ByteRange(0, 100_000), [memoryview(bytearray(100_000))])
            with pytest.raises(RetryableError):
                await cut.write("other", [memoryview(b"x")])
            await cut.close()
        await good.close()

    run(body)


# -- GCS-specific behaviour against the emulator --------------------------------------------


def test_listing_paginates(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    keys = [f"p/obj-{i:03d}" for i in range(23)] + [f"p/d{j}/x" for j in range(6)] + ["q/other"]
    with FaultProxy(fake_gcs.url, rate=0.0) as counter:  # counts requests, injects nothing
        b = GCSBackend(gcs_url(tmp_path), endpoint=counter.url, list_page_size=4)

        async def body() -> None:
            await asyncio.gather(*(b.write(k, [memoryview(k.encode())]) for k in keys))
            before = counter.requests
            listed = await b.list("p/")
            assert [i.key for i in listed] == sorted(k for k in keys if k.startswith("p/"))
            assert [i.size for i in listed] == [len(i.key) for i in listed]
            assert counter.requests - before == 8  # 29 objects in pages of 4
            before = counter.requests
            children = await b.list_children("p")
            assert children == sorted([f"obj-{i:03d}" for i in range(23)] + [f"d{j}" for j in range(6)])
            # GCS counts objects and sub-prefixes toward a page; the emulator counts objects only.
            assert counter.requests - before >= 6
            assert [i.key for i in await b.list()] == sorted(keys)
            assert await b.list_children() == ["p", "q"]
            await b.close()

        run(body)


def test_commit_race_across_threads_has_one_winner(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """8 committers (own thread, loop, client): one creates the manifest, 7 get FileExistsError."""
    url = gcs_url(tmp_path)
    for round_ in range(3):
        barrier = threading.Barrier(8)
        results: list[BaseException | None] = [None] * 8

        def committer(i: int, round_: int) -> None:
            async def body() -> None:
                b = GCSBackend(url, endpoint=fake_gcs.url)
                barrier.wait()
                try:
                    await b.create_if_absent(f"r{round_}/manifest.json", f"host {i}".encode())
                except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                    results[i] = e
                finally:
                    await b.close()

            asyncio.run(body())

        threads = [threading.Thread(target=committer, args=(i, round_)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        assert all(isinstance(r, FileExistsError) for r in results if r is not None), results

        async def check() -> None:
            b = GCSBackend(url, endpoint=fake_gcs.url)
            assert await b.read(f"r{round_}/manifest.json") == f"host {winners[0]}".encode()
            await b.close()

        run(check)


def test_ranged_reads_are_exact(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    data = payload(3_000_017, 5)
    rng = random.Random(1)

    async def body() -> None:
        for resumable in (False, True):
            b = GCSBackend(
                gcs_url(tmp_path / str(resumable)),
                endpoint=fake_gcs.url,
                resumable_threshold=(1 << 20) if resumable else (64 << 20),
                chunk_size=256 << 10,
            )
            cuts = sorted(rng.randrange(len(data)) for _ in range(7))
            await b.write("obj", split_views(bytearray(data), cuts))
            ranges = [(0, 1), (len(data) - 1, len(data)), (262_143, 262_145), (0, len(data))]
            ranges += [tuple(sorted(rng.randrange(len(data) + 1) for _ in range(2))) for _ in range(30)]
            for start, end in ranges:
                if end == start:
                    continue
                dest = bytearray(end - start)
                cuts = sorted(rng.randrange(end - start + 1) for _ in range(rng.randrange(5)))
                await b.read_into("obj", ByteRange(start, end), split_views(dest, cuts))
                assert dest == data[start:end], (start, end)
            for start, end in [(len(data) - 10, len(data) + 1), (len(data), len(data) + 5)]:
                with pytest.raises(ValueError):
                    await b.read_into("obj", ByteRange(start, end), [memoryview(bytearray(end - start))])
            await b.close()

    run(body)


def test_crc32c_is_sent_in_gcs_form(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """The emulator computes its own CRC32C; ours, as sent, must equal it byte for byte."""
    import aiohttp

    data = payload(1_500_000, 9)

    async def body() -> None:
        b = GCSBackend(
            gcs_url(tmp_path), endpoint=fake_gcs.url, resumable_threshold=1 << 20, chunk_size=256 << 10
        )
        await b.write("multi", [memoryview(data[:1000])])
        await b.write("resumable", [memoryview(data)[:7], memoryview(data)[7:]])
        expected = {
            "multi": base64.b64encode(crc32c.crc32c(data[:1000]).to_bytes(4, "big")).decode(),
            "resumable": base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode(),
        }
        async with aiohttp.ClientSession() as s:
            for key, crc in expected.items():
                name = f"{b.prefix}/{key}".replace("/", "%2F")
                async with s.get(f"{fake_gcs.url}/storage/v1/b/{GCS_TEST_BUCKET}/o/{name}") as r:
                    assert (await r.json())["crc32c"] == crc
        await b.close()

    run(body)


class _UploadRecorder(FaultProxy):
    """A proxy that notes each upload request's ``uploadType`` and ``x-goog-hash``."""

    def __init__(self, upstream: str, **kwargs: Any) -> None:
        super().__init__(upstream, **kwargs)
        self.uploads: list[tuple[str, str | None]] = []

    async def handle(self, request: Any) -> Any:
        if request.path.startswith("/upload/"):
            kind = "chunk" if "upload_id" in request.query else request.query.get("uploadType", "")
            self.uploads.append((kind, request.headers.get("x-goog-hash")))
        return await super().handle(request)


@pytest.mark.parametrize("mode", ["media", "multipart", "resumable"])
def test_damage_in_transit_is_caught_when_uploading(fake_gcs: FakeGCS, tmp_path: Path, mode: str) -> None:
    """A byte flipped on the way, which the emulator does not check: the CRC32C in the upload's
    reply gives it away, as a RetryableError naming the key; a retry replaces the damaged object."""
    data = payload(600_000, 5)
    opts: dict[str, Any] = {
        "media": {},
        "multipart": {"upload": "multipart"},
        "resumable": {"resumable_threshold": 256 << 10, "chunk_size": 256 << 10},
    }[mode]
    with _UploadRecorder(fake_gcs.url, rate=1.0, kinds=("corrupt",)) as proxy:
        b = GCSBackend(gcs_url(tmp_path), endpoint=proxy.url, **opts)

        async def body() -> None:
            try:
                with pytest.raises(RetryableError, match="damaged in transit") as e:
                    await b.write("obj", [memoryview(data)[:1000], memoryview(data)[1000:]])
                assert "'obj'" in str(e.value)
                proxy.rate = 0.0
                await b.write("obj", [memoryview(data)])  # what the engine's retry does
                assert await b.read("obj") == data
                # A commit marker that arrives damaged cannot be replaced by a retry (412): an error.
                proxy.rate = 1.0
                with pytest.raises(OSError, match="exists damaged") as c:
                    await b.create_if_absent("marker", data[:10_000])
                assert not isinstance(c.value, RetryableError)
            finally:
                await b.close()

        run(body)
    assert proxy.injected["corrupt"] >= 2
    # The CRC32C is declared to the server too, where the JSON API takes it: x-goog-hash on a media
    # upload and on a resumable upload's last chunk (multipart and resumable also carry it in metadata).
    crc = base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()
    first_kind = {"media": "media", "multipart": "multipart", "resumable": "chunk"}[mode]
    sent = [h for kind, h in proxy.uploads if kind == first_kind]
    if mode == "multipart":
        assert sent and all(h is None for h in sent)
    else:
        assert f"crc32c={crc}" in sent


# -- faults ---------------------------------------------------------------------------------


async def retried(call: Callable[[], Awaitable[T]], attempts: int = 30) -> tuple[T, int]:
    """The engine's job in miniature: retry RetryableError; returns (result, retries)."""
    for attempt in range(attempts):
        try:
            return await call(), attempt
        except RetryableError as e:
            await asyncio.sleep(min(e.retry_after or 0.0, 0.05))
    raise AssertionError(f"still failing after {attempts} attempts")


def test_faults_through_proxy_are_retryable_and_retries_succeed(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    datas = {f"obj/{i}": payload(50_000 + 997 * i, i) for i in range(12)}
    big = payload(1_300_000, 99)  # resumable: 6 chunks of 256 KiB through the proxy (Location rewritten)
    with FaultProxy(fake_gcs.url, rate=0.25, seed=3, slow_s=0.05) as proxy:
        b = GCSBackend(
            gcs_url(tmp_path), endpoint=proxy.url, resumable_threshold=1 << 20, chunk_size=256 << 10
        )

        async def body() -> int:
            retries = 0
            for key, data in [*datas.items(), ("big", big)]:
                view = memoryview(data)
                retries += (await retried(functools.partial(b.write, key, [view[:333], view[333:]])))[1]
            for key, data in [*datas.items(), ("big", big)]:
                for start, end in [(0, len(data)), (17, len(data) - 5), (len(data) // 2, len(data) // 2 + 1)]:
                    dest = bytearray(end - start)
                    read = functools.partial(b.read_into, key, ByteRange(start, end), [memoryview(dest)])
                    retries += (await retried(read))[1]
                    assert dest == data[start:end], key
            listed, n = await retried(lambda: b.list("obj/"))
            retries += n
            assert [(i.key, i.size) for i in listed] == sorted((k, len(d)) for k, d in datas.items())
            # The commit: a retry after a lost answer finds the object that the lost try made.
            tries = 0

            async def commit() -> None:
                nonlocal tries
                tries += 1
                try:
                    await b.create_if_absent("manifest", b"mine")
                except FileExistsError:
                    assert tries > 1, "FileExistsError on the first try: nobody else commits here"

            retries += (await retried(commit))[1]
            assert (await retried(lambda: b.read("manifest")))[0] == b"mine"
            await b.close()
            return retries

        retries = run(body)
    assert retries > 0 and sum(proxy.injected.values()) > 0
    assert set(proxy.injected) >= {"429", "503", "reset"}, proxy.injected


class _StrictResumable(AppServer):
    """A resumable-upload endpoint that behaves like real GCS where the emulator does not.

    It persists whole 256 KiB granules only; ``faults`` maps the n-th request
    (1-based, status queries included) to a status to fail it with -- a 503
    chunk persists about half its bytes first, a 404 means the session
    expired. Status queries get 308 with the persisted ``Range``; a chunk
    that does not start at the persisted offset is refused.
    """

    def __init__(self, faults: dict[int, int]) -> None:
        super().__init__()
        self.faults = faults
        self.data = bytearray()
        self.requests = 0
        self.status_queries = 0
        self.done: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}

    def _persisted(self) -> web.Response:
        headers = {"Range": f"bytes=0-{len(self.data) - 1}"} if self.data else {}
        return web.Response(status=308, headers=headers)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.method == "POST":
            self.meta = json.loads(body)
            return web.Response(headers={"Location": f"{self.url}/upload/session?upload_id=1"})
        self.requests += 1
        fault = self.faults.get(self.requests)
        spec = request.headers["Content-Range"].removeprefix("bytes ")
        span, _, total = spec.partition("/")
        if span == "*":
            self.status_queries += 1
            if fault:
                return web.Response(status=fault)
            return web.json_response(self.done) if self.done else self._persisted()
        start = int(span.partition("-")[0])
        if start != len(self.data):
            return web.Response(status=400, text=f"chunk at {start}, persisted {len(self.data)}")
        if fault:
            if fault == 503:
                self.data += body[: (len(body) // 2) // (256 << 10) * (256 << 10)]
            return web.Response(status=fault, text="injected")
        self.data += body
        if total != "*" and len(self.data) == int(total):
            crc = base64.b64encode(crc32c.crc32c(self.data).to_bytes(4, "big")).decode()
            self.done = {"name": self.meta["name"], "size": total, "crc32c": crc}
            return web.json_response(self.done)
        return self._persisted()


def test_resumable_upload_resumes_a_failed_chunk_from_the_persisted_offset() -> None:
    data = payload(5 * (1 << 20) + 12345, 4)
    small_chunks: dict[str, Any] = {"resumable_threshold": 1 << 20, "chunk_size": 1 << 20}

    def upload(faults: dict[int, int], resume: bool) -> _StrictResumable:
        with _StrictResumable(faults) as server:
            b = GCSBackend("gs://bkt/p", endpoint=server.url, resume_chunks=resume, **small_chunks)

            async def body() -> None:
                try:
                    await b.write("big", [memoryview(data)[:100], memoryview(data)[100:]])
                finally:
                    await b.close()

            run(body)
        return server

    # Chunks 2 and 4 fail after persisting half; the first status query after chunk 2 fails too.
    server = upload({2: 503, 3: 503, 5: 503}, resume=True)
    assert bytes(server.data) == data and server.done is not None
    assert server.status_queries == 3 and server.meta["name"] == "p/big" and server.meta["crc32c"]
    # Without resuming (the emulator's mode) a failed chunk surfaces for the engine to retry.
    with pytest.raises(RetryableError, match="503"):
        upload({2: 503}, resume=False)
    # An expired session is no missing object: RetryableError, so the engine starts a new upload.
    with pytest.raises(RetryableError, match="session is gone"):
        upload({2: 404}, resume=True)
    with pytest.raises(RetryableError, match="session is gone"):
        upload({2: 503, 3: 410}, resume=True)


# -- helpers --------------------------------------------------------------------------------------


def test_rate_ramp_doubles_and_queues() -> None:
    now = [100.0]
    ramp = RateRamp(10.0, doubling_s=60.0, clock=lambda: now[0])
    assert [ramp.reserve() for _ in range(10)] == [0.0] * 10  # one second's burst
    assert ramp.reserve() == pytest.approx(0.1)  # then queued at 10/s
    assert ramp.reserve() == pytest.approx(0.2)
    now[0] += 60.0
    assert ramp.rate() == pytest.approx(20.0)
    now[0] += 120.0
    assert ramp.rate() == pytest.approx(80.0)
    capped = RateRamp(10.0, doubling_s=1.0, max_per_s=15.0, clock=lambda: now[0])
    capped.reserve()
    now[0] += 100.0
    assert capped.rate() == 15.0
    with pytest.raises(ValueError):
        RateRamp(0.0)


def test_header_parsers() -> None:
    assert parse_retry_after("3") == 3.0 and parse_retry_after(" 2.5 ") == 2.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_rfc3339("1970-01-01T00:00:01Z") == 1.0
    assert parse_rfc3339("1970-01-01T00:00:01.5Z") == 1.5
    assert parse_rfc3339("1970-01-01T00:00:01.123456789Z") == pytest.approx(1.123456)
    assert parse_rfc3339("1970-01-01T01:00:00+01:00") == 0.0


def test_gs_urls_reach_the_emulator_through_the_environment(gcs_emulator_env: str, tmp_path: Path) -> None:
    async def body() -> None:
        b = open_backend(gcs_url(tmp_path))
        assert isinstance(b, GCSBackend) and b.emulated and b.endpoint == gcs_emulator_env
        await b.write("k", [memoryview(b"v")])
        assert await b.read("k") == b"v"
        await b.close()

    run(body)
