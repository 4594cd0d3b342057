"""FsspecBackend: the shared conformance suite on three fsspec filesystems, plus fsspec-specific tests.

* fsspec's in-memory filesystem (``fsspec+memory://``, a root per test);
* gcsfs against the module's fake-gcs-server (``fake_gcs`` in conftest);
* s3fs against a moto server this module starts on 127.0.0.1 (skipped
  without s3fs and moto[server]): the proof on a real S3 protocol, where the
  commit marker is a PUT with ``If-None-Match: *``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import os
import pickle
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

# Before anything imports gcsfs: with its experimental zonal-bucket support on (the default),
# every bucket operation against the emulator waits out a 60 s gRPC deadline.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import fsspec
import numpy as np
import pytest
from tests.conftest import GCS_TEST_BUCKET
from fake_gcs import FakeGCS, free_port
from fsspec.implementations.memory import MemoryFileSystem
from paths import WORKERS

import ckptio
from ckptio.backends import ByteRange, RetryableError, ThrottledError, backend_class, open_backend
from ckptio.backends.fsspec_backend import FsspecBackend, FsspecConfig, _one_bytes, translate_error
from ckptio.backends.gcs import GCSBackend
from ckptio.testing import BackendConformance

T = TypeVar("T")


def run(body: Callable[..., Awaitable[T]], *args: Any) -> T:
    return asyncio.run(body(*args))  # type: ignore[arg-type]


def _root(tmp_path: Path) -> str:
    return str(tmp_path).strip("/")


def memory_url(tmp_path: Path) -> str:
    """A root in fsspec's process-wide memory store that no other test uses."""
    return f"fsspec+memory://{_root(tmp_path)}"


def forget_memory(tmp_path: Path) -> None:
    """Drop the test's objects from fsspec's process-wide memory store."""
    root = _root(tmp_path) + "/"
    for path in [p for p in MemoryFileSystem.store if root in p]:
        MemoryFileSystem.store.pop(path, None)


def gcs_options(server: FakeGCS) -> dict[str, Any]:
    return {"storage_options": {"endpoint_url": server.url, "token": "anon"}}


def gcs_url(tmp_path: Path) -> str:
    return f"fsspec+gs://{GCS_TEST_BUCKET}/{_root(tmp_path)}"


# -- a moto S3 server for this module ----------------------------------------------------

S3_BUCKET = "ckptio-s3-test"


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[str]:
    """A fresh moto server on 127.0.0.1 with bucket :data:`S3_BUCKET`; stopped by pid. Returns its URL."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    pytest.importorskip("flask")  # moto[server]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS / "moto_atomic_server.py"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/moto-api/", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto server did not start (exit code {proc.poll()})")
                time.sleep(0.1)
        req = urllib.request.Request(f"{url}/{S3_BUCKET}", method="PUT")  # moto needs no signature
        with urllib.request.urlopen(req, timeout=30):
            pass
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_options(endpoint: str) -> dict[str, Any]:
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    return {"storage_options": {**opts, "client_kwargs": {"region_name": "us-east-1"}}}


def s3_url(tmp_path: Path) -> str:
    return f"fsspec+s3://{S3_BUCKET}/{_root(tmp_path)}"


# -- the shared suite ----------------------------------------------------------------------


class TestFsspecMemory(BackendConformance):
    def make_backend(self, tmp_path: Path) -> FsspecBackend:
        return FsspecBackend(memory_url(tmp_path))

    @pytest.fixture(autouse=True)
    def _forget(self, tmp_path: Path) -> Iterator[None]:
        yield  # not in close_backend: several clients of one root close at different times
        forget_memory(tmp_path)


@pytest.mark.gcs
class TestFsspecGCS(BackendConformance):
    """gcsfs against fake-gcs-server; the commit marker is a multipart upload with ifGenerationMatch=0."""

    state_machine_examples = 12

    @pytest.fixture(autouse=True)
    def _gcs_server(self, fake_gcs: FakeGCS) -> None:
        pytest.importorskip("gcsfs")
        self.server = fake_gcs

    def make_backend(self, tmp_path: Path) -> FsspecBackend:
        return FsspecBackend(gcs_url(tmp_path), **gcs_options(self.server))


class TestFsspecS3(BackendConformance):
    """s3fs against moto: PUTs, ranged GETs, If-None-Match creates, delimiter listings."""

    state_machine_examples = 12

    @pytest.fixture(autouse=True)
    def _s3_server(self, moto_s3: str) -> None:
        self.endpoint = moto_s3

    def make_backend(self, tmp_path: Path) -> FsspecBackend:
        return FsspecBackend(s3_url(tmp_path), **s3_options(self.endpoint))


# -- the commit race: committers in their own thread, loop and client -----------------------


def _committer(
    make: Callable[[], FsspecBackend], key: str, data: bytes, barrier: threading.Barrier
) -> BaseException | None:
    """One host's commit, in the calling thread's own loop and client; returns what it raised."""

    async def body() -> BaseException | None:
        b = make()
        assert b.capabilities.conditional_create
        barrier.wait(30)
        try:
            await b.create_if_absent(key, data)
        except BaseException as e:  # noqa: BLE001 - returned for the assertion
            return e
        finally:
            await b.close()
        return None

    return asyncio.run(body())


def commit_race(make: Callable[[], FsspecBackend], rounds: int = 3, hosts: int = 8) -> None:
    """Each round, ``hosts`` committers create one marker at once: one wins, the rest get FileExistsError."""
    for round_ in range(rounds):
        key = f"r{round_}/manifest.json"
        barrier = threading.Barrier(hosts)
        with concurrent.futures.ThreadPoolExecutor(hosts) as pool:
            futures = [
                pool.submit(_committer, make, key, f"host {i}".encode(), barrier) for i in range(hosts)
            ]
            results = [f.result(timeout=60) for f in futures]
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1, results
        assert all(isinstance(r, FileExistsError) for r in results if r is not None), results
        assert run(make().read, key) == f"host {winners[0]}".encode()


def test_commit_race_memory(tmp_path: Path) -> None:
    try:
        commit_race(lambda: FsspecBackend(memory_url(tmp_path)))
    finally:
        forget_memory(tmp_path)


@pytest.mark.gcs
def test_commit_race_gcsfs(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    pytest.importorskip("gcsfs")
    commit_race(lambda: FsspecBackend(gcs_url(tmp_path), **gcs_options(fake_gcs)))


def test_commit_race_s3fs(moto_s3: str, tmp_path: Path) -> None:
    commit_race(lambda: FsspecBackend(s3_url(tmp_path), **s3_options(moto_s3)))


# -- URLs, options, capabilities, pickling ------------------------------------------------


def test_open_backend_resolves_fsspec_urls(tmp_path: Path) -> None:
    assert backend_class("fsspec+anything") is FsspecBackend
    assert backend_class("fsspec") is FsspecBackend
    mem = open_backend(memory_url(tmp_path) + "/", storage_options={"global_store": True}, concurrency=2)
    assert isinstance(mem, FsspecBackend) and mem.url == memory_url(tmp_path) and mem.protocol == "memory"
    assert mem.config.storage_options == {"global_store": True} and mem.capabilities.concurrency == 2
    assert open_backend("FSSPEC+Memory://x").url == "fsspec+memory://x"  # schemes are case-insensitive
    with pytest.raises(ValueError, match="fsspec\\+<protocol>"):  # the error lists the family
        open_backend("nosuchscheme://x")
    for bad in ("fsspec+memory://", "fsspec+memory:///", "fsspec+://x", "memory://x", "fsspec+s3::gs://b"):
        with pytest.raises(ValueError):
            FsspecBackend(bad)
    with pytest.raises(ValueError, match="Protocol not known"):
        open_backend("fsspec+no-such-protocol://x")
    with pytest.raises(ValueError, match="manages"):
        FsspecBackend(memory_url(tmp_path), storage_options={"asynchronous": False})


@pytest.mark.gcs
def test_fsspec_gs_and_native_gs_share_a_bucket(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """``fsspec+gs://`` goes through gcsfs; a plain ``gs://`` keeps the native backend, on the same objects."""
    pytest.importorskip("gcsfs")
    gs = open_backend(gcs_url(tmp_path), storage_options={"endpoint_url": fake_gcs.url, "token": "anon"})
    assert isinstance(gs, FsspecBackend) and gs.protocol == "gs" and gs.capabilities.conditional_create
    assert gs.config.storage_options == {"endpoint_url": fake_gcs.url, "token": "anon"}
    native = open_backend(f"gs://{GCS_TEST_BUCKET}/{_root(tmp_path)}", endpoint=fake_gcs.url)
    assert isinstance(native, GCSBackend)

    async def body() -> None:
        await gs.write("k", [memoryview(b"through gcsfs")])
        assert await native.read("k") == b"through gcsfs"
        await native.create_if_absent("marker", b"native")
        with pytest.raises(FileExistsError):
            await gs.create_if_absent("marker", b"fsspec")
        await native.close()
        await gs.close()

    run(body)


def test_open_backend_resolves_s3(moto_s3: str, tmp_path: Path) -> None:
    b = open_backend(s3_url(tmp_path), **s3_options(moto_s3))
    assert isinstance(b, FsspecBackend) and b.protocol == "s3"
    caps = b.capabilities
    # s3fs takes mode="create" (If-None-Match): a real conditional create.
    assert caps.conditional_create and caps.atomic_write and caps.list_consistent and b.layout_defaults.hashed_names


def test_capabilities_follow_the_protocol(tmp_path: Path) -> None:
    mem_backend = FsspecBackend(memory_url(tmp_path))
    mem = mem_backend.capabilities
    assert mem.conditional_create and mem.atomic_write and mem.durable_on_close
    assert mem_backend.layout_defaults.hashed_names
    local_backend = FsspecBackend(f"fsspec+file://{tmp_path}")
    local = local_backend.capabilities
    # Written in place, no fsync through fsspec, no conditional create: the native local backend has all three.
    assert not local.conditional_create and not local.atomic_write and not local.durable_on_close
    assert not local_backend.layout_defaults.hashed_names
    tuned = FsspecBackend(memory_url(tmp_path), object_size=1 << 20, concurrency=3, hashed_names=False)
    assert (tuned.layout_defaults.object_size, tuned.capabilities.concurrency) == (1 << 20, 3)
    assert not tuned.layout_defaults.hashed_names
    # A config can give up the conditional create (an S3 clone that ignores If-None-Match), not invent one.
    assert not FsspecBackend(memory_url(tmp_path), conditional_create=False).capabilities.conditional_create
    assert not FsspecBackend(
        f"fsspec+file://{tmp_path}", conditional_create=True
    ).capabilities.conditional_create


def test_check_then_write_fallback(tmp_path: Path) -> None:
    """Without a conditional create the check still refuses an existing key (only racers slip through)."""

    async def body() -> None:
        for b in (
            FsspecBackend(memory_url(tmp_path / "mem"), conditional_create=False),
            FsspecBackend(f"fsspec+file://{tmp_path}/local"),
        ):
            await b.create_if_absent("c/marker", b"one")
            with pytest.raises(FileExistsError, match="'c/marker'"):
                await b.create_if_absent("c/marker", b"two")
            assert await b.read("c/marker") == b"one"
            await b.close()

    try:
        run(body)
    finally:
        forget_memory(tmp_path)


def test_config_and_backend_pickle(tmp_path: Path) -> None:
    config = FsspecConfig(storage_options={"client_kwargs": {"region_name": "x"}}, concurrency=4)
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.concurrency = 5  # type: ignore[misc]
    b = FsspecBackend(memory_url(tmp_path), config, object_size=1 << 20)

    async def body() -> None:
        await b.write("k", [memoryview(b"v")])  # a live filesystem must not stop the pickling
        clone = pickle.loads(pickle.dumps(b))
        assert isinstance(clone, FsspecBackend) and clone.url == b.url and clone.config == b.config
        assert await clone.read("k") == b"v"

    try:
        run(body)
    finally:
        forget_memory(tmp_path)


def test_write_copies_at_most_once() -> None:
    whole = b"immutable bytes"
    assert _one_bytes([memoryview(whole)]) is whole  # passed as is
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert _one_bytes([memoryview(arr)]) == arr.tobytes()
    assert _one_bytes([memoryview(whole)[:3], memoryview(arr)]) == whole[:3] + arr.tobytes()
    assert _one_bytes([]) == b""


# -- errors --------------------------------------------------------------------------------


def _checks_messages(b: FsspecBackend) -> Callable[[], Awaitable[None]]:
    async def body() -> None:
        await b.write("short", [memoryview(b"0123456789")])
        for call in (
            lambda: b.read("missing/key"),
            lambda: b.stat("missing/key"),
            lambda: b.delete("missing/key"),
            lambda: b.read_into("missing/key", ByteRange(0, 4), [memoryview(bytearray(4))]),
            lambda: b.read_into("missing/key", ByteRange(0, 0), []),
        ):
            with pytest.raises(FileNotFoundError) as info:
                await call()
            assert b.url in str(info.value) and "'missing/key'" in str(info.value)
        for start, end in [(5, 11), (10, 12), (20, 30), (11, 11)]:
            with pytest.raises(ValueError, match="past the end") as info:
                await b.read_into("short", ByteRange(start, end), [memoryview(bytearray(end - start))])
            assert b.url in str(info.value) and "'short'" in str(info.value)
        await b.close()

    return body


def test_errors_name_url_and_key_memory(tmp_path: Path) -> None:
    try:
        run(_checks_messages(FsspecBackend(memory_url(tmp_path))))
    finally:
        forget_memory(tmp_path)


@pytest.mark.gcs
def test_errors_name_url_and_key_gcsfs(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    pytest.importorskip("gcsfs")
    run(_checks_messages(FsspecBackend(gcs_url(tmp_path), **gcs_options(fake_gcs))))


def test_errors_name_url_and_key_s3fs(moto_s3: str, tmp_path: Path) -> None:
    run(_checks_messages(FsspecBackend(s3_url(tmp_path), **s3_options(moto_s3))))


class _Status(Exception):
    """Stands in for gcsfs's HttpError (``code``) and aiohttp's ClientResponseError (``status``)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"status {code}")
        self.code = code


class _BotoLike(Exception):
    def __init__(self, status: int) -> None:
        super().__init__("boto")
        self.response = {"Error": {"Code": "X"}, "ResponseMetadata": {"HTTPStatusCode": status}}


def _caused(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause  # s3fs translates a ClientError and chains it like this
    return outer


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (FileNotFoundError("gone"), FileNotFoundError),
        (IsADirectoryError("a dir"), FileNotFoundError),
        (FileExistsError("there"), FileExistsError),
        (PermissionError("no"), PermissionError),
        (OSError(errno.EACCES, "denied"), PermissionError),
        (OSError("Forbidden: bkt/o\nno storage.objects.get access"), PermissionError),
        (_Status(404), FileNotFoundError),
        (_Status(412), FileExistsError),
        (_Status(403), PermissionError),
        (_Status(401), PermissionError),
        (_Status(408), RetryableError),
        (_Status(429), ThrottledError),  # the storage says "slow down": the request budget answers it
        (_Status(503), ThrottledError),
        (_Status(416), ValueError),
        (_caused(OSError(errno.EIO, "odd"), _BotoLike(500)), RetryableError),
        (OSError(errno.EBUSY, "SlowDown"), ThrottledError),  # s3fs's throttling (#38): the budget answers it
        (OSError(errno.EBUSY, "Please reduce your request rate. ThrottlingException"), ThrottledError),
        (OSError(errno.EBUSY, "OperationAborted"), RetryableError),  # s3fs's EBUSY for a conflict, not throttling
        (TimeoutError("slow"), RetryableError),
        (asyncio.TimeoutError(), RetryableError),
        (ConnectionResetError("reset"), RetryableError),
        (ValueError("bad argument"), ValueError),
        (RuntimeError("something else"), OSError),
    ],
)
def test_translate_error(error: BaseException, expected: type[BaseException]) -> None:
    out = translate_error(error, "fsspec+s3://b/p: reading 'k'")
    assert type(out) is expected
    assert str(out).startswith("fsspec+s3://b/p: reading 'k'")
    assert not isinstance(out, RetryableError) or issubclass(expected, RetryableError)


def test_translate_error_knows_the_http_stacks() -> None:
    aiohttp = pytest.importorskip("aiohttp")
    for e in (aiohttp.ClientConnectionError("refused"), aiohttp.ClientPayloadError("cut off")):
        assert isinstance(translate_error(e, "w"), RetryableError)
    gcsfs_retry = pytest.importorskip("gcsfs.retry")
    assert isinstance(
        translate_error(gcsfs_retry.HttpError({"code": 503, "message": "x"}), "w"), RetryableError
    )
    assert isinstance(translate_error(gcsfs_retry.HttpError({"code": 404}), "w"), FileNotFoundError)
    assert isinstance(translate_error(gcsfs_retry.ChecksumError("md5"), "w"), RetryableError)
    botocore = pytest.importorskip("botocore.exceptions")
    for e in (
        botocore.EndpointConnectionError(endpoint_url="x"),
        botocore.ReadTimeoutError(endpoint_url="x"),
    ):
        assert isinstance(translate_error(e, "w"), RetryableError)


class _FaultyMemory(MemoryFileSystem):
    """fsspec's memory filesystem whose every call raises ``fault`` while it is set."""

    protocol = "ckptiofaulty"
    fault: BaseException | None = None

    def _maybe_fail(self) -> None:
        if type(self).fault is not None:
            raise type(self).fault

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._maybe_fail()
        super().pipe_file(path, value, mode=mode, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        self._maybe_fail()
        return super().cat_file(path, start, end, **kwargs)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._maybe_fail()
        return super().info(path, **kwargs)


def test_errors_are_translated_at_the_boundary(tmp_path: Path) -> None:
    fsspec.register_implementation("ckptiofaulty", _FaultyMemory, clobber=True)
    b = FsspecBackend(f"fsspec+ckptiofaulty://{_root(tmp_path)}")
    assert not b.capabilities.conditional_create  # an unknown protocol: check-then-write

    async def body() -> None:
        await b.write("k", [memoryview(b"data")])
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: b.write("k", [memoryview(b"x")]),
            lambda: b.read_into("k", ByteRange(0, 2), [memoryview(bytearray(2))]),
            lambda: b.stat("k"),
            lambda: b.create_if_absent("k2", b"x"),
            lambda: b.delete("k"),
        ]
        for fault, expected in [
            (ConnectionResetError("reset by peer"), RetryableError),
            (OSError(errno.EBUSY, "SlowDown"), ThrottledError),
            (PermissionError("AccessDenied"), PermissionError),
        ]:
            _FaultyMemory.fault = fault
            try:
                for call in calls:
                    with pytest.raises(expected) as info:
                        await call()
                    assert b.url in str(info.value) and "'k" in str(info.value), info.value
                    assert info.value.__cause__ is fault
            finally:
                _FaultyMemory.fault = None
        assert await b.read("k") == b"data"  # nothing was changed by the failed calls

    try:
        run(body)
    finally:
        forget_memory(tmp_path)


# -- loops and the native API ------------------------------------------------------------------


def test_native_save_and_restore_through_fsspec_memory(tmp_path: Path) -> None:
    url = memory_url(tmp_path)
    rng = np.random.default_rng(0)
    state = {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "b": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float16),
        "step": 5,
        "note": "héllo",
    }
    try:
        manifest = ckptio.save(url, state, step=5, backend_options={"object_size": 4096}).result()
        assert manifest is not None and len(manifest.objects) > 1
        assert all(k.split("/")[0].startswith("h") for k in manifest.objects)  # hashed names: an object store
        ckptio.save(url, {**state, "step": 6}, step=6).result()
        out = ckptio.restore(url, step=5)
        for name in ("w", "b", "empty"):
            assert out[name].dtype == state[name].dtype and out[name].tobytes() == state[name].tobytes()
        assert out["step"] == 5 and out["note"] == "héllo"
        assert ckptio.restore(url)["step"] == 6  # the newest committed
    finally:
        forget_memory(tmp_path)
