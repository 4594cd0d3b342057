"""LocalBackend against the shared conformance suite, in each of its modes, plus POSIX-only tests."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptio.backends import RetryableError, open_backend
from ckptio.backends._posix import aligned_buffer
from ckptio.backends.base import Backend, ByteRange
from ckptio.backends.local import TMP_MARK, LocalBackend, LocalConfig
from ckptio.testing import BackendConformance

# -- O_DIRECT: find a file system that takes it ------------------------------


def _takes_o_direct(directory: Path) -> bool:
    """Whether an aligned O_DIRECT write works in ``directory`` (tmpfs, overlayfs may refuse)."""
    probe = directory / f".o-direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, aligned_buffer(4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


@functools.cache
def _direct_base(tmp_parent: Path) -> Path | str:
    """Where O_DIRECT tests under ``tmp_parent`` keep files: ``tmp_parent``, another directory, or why nowhere."""
    if _takes_o_direct(tmp_parent):
        return tmp_parent
    for candidate in (os.environ.get("CKPTIO_TEST_DIRECT_DIR"), "/var/tmp", str(Path.cwd())):
        if candidate and os.path.isdir(candidate) and _takes_o_direct(Path(candidate)):
            return Path(tempfile.mkdtemp(prefix="ckptio-direct-", dir=candidate))
    return (
        "no file system here accepts O_DIRECT (tried pytest's tmp dir, "
        "$CKPTIO_TEST_DIRECT_DIR, /var/tmp and the working directory)"
    )


def _mirror_name(tmp_path: Path) -> str:
    return str(tmp_path).strip("/").replace("/", "_")


def direct_root(tmp_path: Path) -> Path:
    """A directory for an O_DIRECT backend standing for ``tmp_path``; skips if no file system takes O_DIRECT."""
    base = _direct_base(tmp_path.parent)
    if isinstance(base, str):
        pytest.skip(base)
    if base == tmp_path.parent:
        return tmp_path
    # Elsewhere: mirror tmp_path's name, so that the same tmp_path gives the same storage.
    root = base / _mirror_name(tmp_path)
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture
def direct_cleanup(tmp_path: Path) -> Iterator[None]:
    """Removes what O_DIRECT tests left outside pytest's tmp dir (when they had to go elsewhere)."""
    yield
    base = _direct_base(tmp_path.parent)
    if isinstance(base, Path) and base != tmp_path.parent:
        for leftover in base.glob(_mirror_name(tmp_path) + "*"):
            shutil.rmtree(leftover, ignore_errors=True)


# -- the suite, once per mode ----------------------------------------------


class TestLocalBackend(BackendConformance):
    """Default config: fsync on, page cache."""

    def make_backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(str(tmp_path / "root"))


class TestLocalBackendNoFsync(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(str(tmp_path / "root"), fsync=False)


class TestLocalBackendDirect(BackendConformance):
    """O_DIRECT for the aligned bulk of each write."""

    def make_backend(self, tmp_path: Path) -> Backend:
        return LocalBackend(str(direct_root(tmp_path) / "root"), direct=True, direct_reads=True)

    @pytest.fixture(autouse=True)
    def _cleanup(self, direct_cleanup: None) -> None:
        pass

    def test_writes_really_use_o_direct(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        flags: list[int] = []
        real_open = os.open

        def spy(path: Any, flag: int, *args: Any, **kwargs: Any) -> int:
            flags.append(flag)
            return real_open(path, flag, *args, **kwargs)

        monkeypatch.setattr(os, "open", spy)

        from ckptio.backends._bounce import BOUNCE

        async def body(b: Backend) -> None:
            assert b.capabilities.alignment == 4096
            # O_DIRECT is for bulk IO (>= 1 MiB); unaligned memory goes through a bounce buffer.
            data = os.urandom(256 * 4096 + 5)
            lent = BOUNCE.lent
            await b.write("direct", [memoryview(data)[:7], memoryview(data)[7:]])
            assert await b.read("direct") == data
            assert BOUNCE.lent > lent, "unaligned memory must be gathered into an aligned bounce buffer"
            # Page-aligned memory at aligned offsets goes to the device as it is: no bounce copy.
            lent = BOUNCE.lent
            aligned = aligned_buffer(2 << 20)
            aligned[:] = os.urandom(2 << 20)
            await b.write("zero-copy", [aligned[: 1 << 20], aligned[1 << 20 :], memoryview(b"tail")])
            assert BOUNCE.lent == lent
            got = np.empty((2 << 20) + 4, np.uint8)  # read back into memory numpy allocated
            await b.read_into("zero-copy", ByteRange(0, got.nbytes), [memoryview(got)])
            assert got.tobytes() == bytes(aligned) + b"tail"

        self.run_with_backend(tmp_path, body)
        assert any(f & os.O_DIRECT for f in flags), "no file was opened with O_DIRECT"

    def test_a_filling_write_goes_out_request_by_request_as_its_bytes_arrive(self, tmp_path: Path) -> None:
        """The direct path streams: requests leave while the fill is still going, none larger than
        one bounce buffer, each after its bytes are in (the conformance check: none read early)."""
        from ckptio.backends._direct import REQUEST_BYTES
        from ckptio.testing._filling_checks import PieceFilling, filling_object

        async def body(b: Backend) -> None:
            src, buf, views = filling_object((20 << 20) + 99, 3)
            filling = PieceFilling(src, memoryview(buf), 1 << 20).start()
            await b.write_filling("streamed", views, filling)
            assert await b.read("streamed") == src
            ends = [end for end, _in in filling.waits]
            assert ends == sorted(ends) and ends[-1] == len(src)
            early = [arrived for _end, arrived in filling.waits if arrived < len(src)]
            assert early, "no request left before the fill ended"
            assert all(b - a <= REQUEST_BYTES for a, b in zip([0, *ends], ends) if b < len(src) - 4096)

        self.run_with_backend(tmp_path, body)


# -- POSIX-only behaviour --------------------------------------------------


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TMP_MARK in p.name]


def test_url_forms_and_capabilities(tmp_path: Path) -> None:
    plain = open_backend(str(tmp_path))
    by_url = open_backend(f"file://{tmp_path}")
    assert isinstance(plain, LocalBackend) and isinstance(by_url, LocalBackend)
    assert plain.root == by_url.root == str(tmp_path)
    assert LocalBackend(str(tmp_path), direct=False).capabilities.alignment == 1
    assert LocalBackend(str(tmp_path)).capabilities.alignment == 4096  # O_DIRECT by default
    # fsync'd files still need sync() for their directory entries.
    assert not LocalBackend(str(tmp_path)).capabilities.durable_on_close
    with pytest.raises(ValueError):
        LocalBackend("file://")


def test_keys_cannot_escape_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (tmp_path / "secret").write_bytes(b"outside")
    b = LocalBackend(str(root))

    async def main() -> None:
        for key in ("../secret", "a/../../secret", "/etc/passwd", str(tmp_path / "secret")):
            with pytest.raises(ValueError):
                b.path(key)
            with pytest.raises(ValueError):
                await b.write(key, [memoryview(b"pwned")])
            with pytest.raises(ValueError):
                await b.read(key)
            with pytest.raises(ValueError):
                await b.delete(key)
        for prefix in ("../", "../s", "/", "/etc/", "a/../../"):
            with pytest.raises(ValueError):
                await b.list(prefix)
            with pytest.raises(ValueError):
                await b.list_children(prefix)
        with pytest.raises(ValueError):
            await b.list_children("..")
        assert await b.list() == []

    run(main())
    assert (tmp_path / "secret").read_bytes() == b"outside"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret"]  # the root was never even created


def test_temp_files_are_invisible(tmp_path: Path) -> None:
    b = LocalBackend(str(tmp_path))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / f"{TMP_MARK}abc").write_bytes(b"partial")
    (tmp_path / f"{TMP_MARK}top").write_bytes(b"partial")

    async def main() -> None:
        await b.write("d/obj", [memoryview(b"whole")])
        assert [i.key for i in await b.list()] == ["d/obj"]
        assert await b.list_children() == ["d"]
        assert await b.list_children("d") == ["obj"]

    run(main())


_KILLED_WRITER = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from ckptio.backends.local import LocalBackend

    root, op = sys.argv[1], sys.argv[2]
    # A write of 3000 buffers takes several pwritev batches (IOV_MAX): die after the first,
    # so the object is half on disk. The commit object is one pwritev: die before it.
    die_at = 2 if op == "write" else 1
    real_pwritev, calls = os.pwritev, [0]

    def dying_pwritev(fd, buffers, offset):
        calls[0] += 1
        if calls[0] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_pwritev(fd, buffers, offset)

    os.pwritev = dying_pwritev
    b = LocalBackend(root)
    if op == "write":
        asyncio.run(b.write("ckpt/obj", [memoryview(bytes([7]) * 100)] * 3000))
    else:
        asyncio.run(b.create_if_absent("ckpt/manifest", bytes(5000)))
    print("survived")
    """
)


@pytest.mark.parametrize("op", ["write", "create_if_absent"])
def test_killed_writer_leaves_no_partial_object(tmp_path: Path, op: str) -> None:
    b = LocalBackend(str(tmp_path))
    run(b.write("ckpt/obj", [memoryview(b"old")]))
    run(b.write("ckpt/other", [memoryview(b"x")]))

    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), op], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert tmp_files(tmp_path), "the writer died before leaving a temp file: the test proves nothing"

    async def main() -> None:
        assert [(i.key, i.size) for i in await b.list()] == [("ckpt/obj", 3), ("ckpt/other", 1)]
        assert await b.list_children("ckpt") == ["obj", "other"]
        assert await b.read("ckpt/obj") == b"old"  # the old version, whole
        with pytest.raises(FileNotFoundError):
            await b.stat("ckpt/manifest")
        # The dead writer's leftovers block nothing.
        await b.write("ckpt/obj", [memoryview(b"new")])
        await b.create_if_absent("ckpt/manifest", b"{}")
        assert await b.read("ckpt/obj") == b"new"
        # ... and the sweep removes them, once no write in progress can own them.
        assert await b.sweep_temporaries(3600) == []
        leftovers = await b.sweep_temporaries(0, dry_run=True)
        assert leftovers and all(name.startswith("ckpt/.ckptio-tmp-") for name in leftovers), leftovers
        assert tmp_files(tmp_path)
        assert await b.sweep_temporaries(0) == leftovers
        assert not tmp_files(tmp_path)
        assert [i.key for i in await b.list()] == ["ckpt/manifest", "ckpt/obj", "ckpt/other"]

    run(main())


@pytest.mark.parametrize(
    ("err", "expected"),
    [
        (errno.EAGAIN, RetryableError),
        (errno.EINTR, RetryableError),
        (errno.EACCES, PermissionError),
        (errno.EROFS, PermissionError),
        (errno.EIO, OSError),
        (errno.ENOSPC, OSError),
    ],
    ids=lambda v: errno.errorcode[v] if isinstance(v, int) else v.__name__,
)
def test_injected_os_errors_are_translated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, expected: type[Exception]
) -> None:
    b = LocalBackend(str(tmp_path))
    run(b.write("obj", [memoryview(b"before")]))

    def failing(*args: Any) -> int:
        raise OSError(err, os.strerror(err))

    def check(exc: BaseException, what: str) -> None:
        assert isinstance(exc, expected), repr(exc)
        # Nothing more specific than asked: EIO must not pose as a missing or existing file.
        if expected is OSError:
            assert type(exc) is OSError and exc.errno == err, repr(exc)
        assert "'obj'" in str(exc), f"{what}: the error does not name the key: {exc}"

    async def main() -> None:
        with monkeypatch.context() as m:
            m.setattr(os, "pwritev", failing)
            with pytest.raises(Exception) as info:
                await b.write("obj", [memoryview(b"after")])
            check(info.value, "write")
        with monkeypatch.context() as m:
            m.setattr(os, "preadv", failing)
            with pytest.raises(Exception) as info:
                await b.read("obj")
            check(info.value, "read")
        with monkeypatch.context() as m:
            m.setattr(os, "unlink", failing)
            with pytest.raises(Exception) as info:
                await b.delete("obj")
            check(info.value, "delete")
        assert await b.read("obj") == b"before"  # the failed write changed nothing
        assert not tmp_files(tmp_path)  # and cleaned up after itself

    run(main())


def test_failed_fsync_fails_the_write_and_leaves_the_old_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = LocalBackend(str(tmp_path))
    run(b.write("obj", [memoryview(b"before")]))

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError) as info:
        run(b.write("obj", [memoryview(b"after")]))
    assert info.value.errno == errno.EIO and "'obj'" in str(info.value)
    monkeypatch.undo()
    assert run(b.read("obj")) == b"before"
    assert not tmp_files(tmp_path)


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(writable source dir, read-only bind mount of it); skips where mounting is not allowed."""
    src, mnt = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount(8): cannot make a read-only file system to test EROFS translation")

    def sh(*cmd: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(cmd, capture_output=True, timeout=30)

    if sh("mount", "--bind", str(src), str(mnt)).returncode != 0:
        pytest.skip("bind mounts are not permitted here (needs CAP_SYS_ADMIN): cannot test EROFS translation")
    try:
        remount = sh("mount", "-o", "remount,bind,ro", str(mnt))
        probe = mnt / "probe"
        if remount.returncode != 0 or _can_create(probe):
            pytest.skip("could not make the bind mount read-only: cannot test EROFS translation")
        yield src, mnt
    finally:
        sh("umount", str(mnt))


def _can_create(path: Path) -> bool:
    try:
        path.write_bytes(b"")
    except OSError as e:
        return e.errno != errno.EROFS
    path.unlink()
    return True


def test_read_only_file_system_gives_permission_error(read_only_mount: tuple[Path, Path]) -> None:
    src, mnt = read_only_mount

    async def main() -> None:
        await LocalBackend(str(src)).write("dir/obj", [memoryview(b"seeded")])
        b = LocalBackend(str(mnt))
        assert await b.read("dir/obj") == b"seeded"
        assert [i.key for i in await b.list()] == ["dir/obj"]
        attempts: list[tuple[str, Callable[[], Any]]] = [
            ("write", lambda: b.write("dir/obj", [memoryview(b"x")])),
            ("write", lambda: b.write("new/dir/obj", [memoryview(b"x")])),
            ("create_if_absent", lambda: b.create_if_absent("dir/manifest", b"{}")),
            ("delete", lambda: b.delete("dir/obj")),
        ]
        for what, attempt in attempts:
            with pytest.raises(PermissionError, match="read-only") as info:
                await attempt()
            assert "obj" in str(info.value) or "manifest" in str(info.value), (what, info.value)
        assert await b.read("dir/obj") == b"seeded"

    run(main())


def test_direct_and_buffered_files_are_identical(tmp_path: Path, direct_cleanup: None) -> None:
    """An O_DIRECT write and a buffered one of the same odd-sized buffers give the same file."""
    base = direct_root(tmp_path)
    data = os.urandom((8 << 20) + 3 * 4096 + 17)
    cuts = [0, 1, 4097, 1 << 20, len(data)]
    views = [memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])]

    async def main() -> None:
        d, p = LocalBackend(str(base / "d"), direct=True), LocalBackend(str(tmp_path / "p"))
        await d.write("x", views)
        await p.write("x", views)
        buf = bytearray(100)
        await d.read_into("x", ByteRange(4000, 4100), [memoryview(buf)])
        assert buf == data[4000:4100]

    run(main())
    assert (base / "d" / "x").read_bytes() == (tmp_path / "p" / "x").read_bytes() == data


@pytest.mark.parametrize("alignment", [0, 3, 4097, 16 << 20, 4096.0, True])
def test_an_alignment_direct_writes_cannot_keep_is_refused_naming_it(alignment: Any) -> None:
    """A power of two up to one bounce buffer: above it every bounce copy would be cut to nothing and a
    direct write of unaligned memory would never end."""
    with pytest.raises(ValueError, match="LocalConfig.alignment"):
        LocalConfig(alignment=alignment)
    assert LocalConfig(alignment=512).alignment == 512 and LocalConfig().alignment == 4096
