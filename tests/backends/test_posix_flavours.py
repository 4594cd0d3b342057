"""Hyperdisk ML and Parallelstore: conformance, mount detection, read-only phase, many readers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.backends.test_local import read_only_mount  # noqa: F401  (a fixture)

import ckptio
from ckptio.backends import detect_scheme, open_backend
from ckptio.backends._posix_commit import lock_path
from ckptio.backends.base import Backend
from ckptio.backends.hyperdisk_ml import HyperdiskMLBackend
from ckptio.backends.parallelstore import ParallelstoreBackend
from ckptio.manage.hdml_publish import is_published, publish
from ckptio.testing import BackendConformance


class TestHyperdiskML(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return HyperdiskMLBackend(str(tmp_path / "root"))


class TestParallelstore(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return ParallelstoreBackend(str(tmp_path / "root"))


# -- the lock-and-rename commit (no hard links on DFS) --------------------------------------------


def _lock_of(root: Path, key: str) -> Path:
    return Path(lock_path(str(root / key)))


def _leave_lock(root: Path, key: str, age_s: float) -> Path:
    """What a committer killed between its lock and its rename leaves: a lock, no object."""
    lock = _lock_of(root, key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (os.stat(lock).st_atime, os.stat(lock).st_mtime - age_s))
    return lock


def test_a_dead_committers_lock_is_taken_over_once_stale(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "root"
    b = ParallelstoreBackend(str(root), lock_stale_s=60.0)
    _leave_lock(root, "7/ckptio.manifest.json", age_s=5.0)
    # A recent lock may be a committer at work: refused, and the key stays free.
    with pytest.raises(FileExistsError):
        asyncio.run(b.create_if_absent("7/ckptio.manifest.json", b"mine"))
    _leave_lock(root, "7/ckptio.manifest.json", age_s=120.0)
    with caplog.at_level("WARNING", logger="ckptio.backends.local"):
        asyncio.run(b.create_if_absent("7/ckptio.manifest.json", b"mine"))
    assert asyncio.run(b.read("7/ckptio.manifest.json")) == b"mine"
    assert "took over a commit lock" in caplog.text
    # Taken over means owned: the fresh lock guards the object like any other commit's.
    with pytest.raises(FileExistsError):
        asyncio.run(b.create_if_absent("7/ckptio.manifest.json", b"again"))
    assert asyncio.run(b.list("7/")) == [asyncio.run(b.stat("7/ckptio.manifest.json"))]  # no leftovers listed
    assert not list(root.glob("7/*stale*"))


def test_a_stale_lock_beside_its_object_blocks_like_any_commit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    b = ParallelstoreBackend(str(root), lock_stale_s=60.0)
    asyncio.run(b.create_if_absent("k", b"first"))
    os.utime(_lock_of(root, "k"), (0, 0))  # ancient, but the object is there: committed
    with pytest.raises(FileExistsError):
        asyncio.run(b.create_if_absent("k", b"second"))
    assert asyncio.run(b.read("k")) == b"first"


def test_sweep_removes_dead_committers_locks_only(tmp_path: Path) -> None:
    root = tmp_path / "root"
    b = ParallelstoreBackend(str(root), lock_stale_s=60.0)
    asyncio.run(b.create_if_absent("1/m", b"committed"))
    os.utime(_lock_of(root, "1/m"), (0, 0))  # old, but guarding its object
    _leave_lock(root, "2/m", age_s=5.0)  # recent: maybe a commit in progress
    dead = _leave_lock(root, "3/m", age_s=120.0)
    assert asyncio.run(b.sweep_temporaries(0)) == [str(dead.relative_to(root))]
    assert _lock_of(root, "1/m").exists() and _lock_of(root, "2/m").exists() and not dead.exists()
    with pytest.raises(FileExistsError):  # the committed key stays guarded
        asyncio.run(b.create_if_absent("1/m", b"again"))


def test_racing_takers_of_a_stale_lock_have_one_winner(tmp_path: Path) -> None:
    import threading

    root = tmp_path / "root"
    for round_ in range(5):
        key = f"r{round_}/ckptio.manifest.json"
        _leave_lock(root, key, age_s=3600.0)
        barrier, outcomes = threading.Barrier(8), [None] * 8

        def taker(i: int, key: str = key, barrier: threading.Barrier = barrier, out: list = outcomes) -> None:
            b = ParallelstoreBackend(str(root), lock_stale_s=60.0)
            barrier.wait()
            try:
                asyncio.run(b.create_if_absent(key, f"taker {i}".encode()))
                out[i] = "won"
            except FileExistsError:
                out[i] = "lost"

        threads = [threading.Thread(target=taker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert outcomes.count("won") == 1 and outcomes.count("lost") == 7, outcomes
        winner = outcomes.index("won")
        b = ParallelstoreBackend(str(root))
        assert asyncio.run(b.read(key)) == f"taker {winner}".encode()


def _mountinfo(tmp_path: Path, mount_point: Path, fstype: str, source: str, opts: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(
        "22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"40 22 0:50 / {mount_point} {opts},nosuid shared:20 - {fstype} {source} {opts}\n"
    )
    return str(path)


def test_read_only_detected_from_injected_mount_table(tmp_path):
    root = tmp_path / "vol"
    info = _mountinfo(tmp_path, root, "ext4", "/dev/sdb", "ro")
    b = HyperdiskMLBackend(f"hdml://{root}", mountinfo=info)
    assert b.capabilities.read_only
    with pytest.raises(PermissionError, match="single-writer"):
        asyncio.run(b.write("x", [memoryview(b"1")]))
    assert detect_scheme(str(root / "run1"), info) == "hdml"
    rw = HyperdiskMLBackend(f"hdml://{root}", mountinfo=_mountinfo(tmp_path, root, "ext4", "/dev/sdb", "rw"))
    assert not rw.capabilities.read_only


def test_dfuse_detected_and_interception_reported(tmp_path, caplog):
    root = tmp_path / "ps"
    info = _mountinfo(tmp_path, root, "fuse.dfuse", "dfuse", "rw")
    b = ParallelstoreBackend(f"pstore://{root}", mountinfo=info, environ={})
    d = b.diagnostics()
    assert d["dfuse"] and d["interception"] is None and "LD_PRELOAD" in d["hint"]
    assert "LD_PRELOAD" in caplog.text
    b2 = ParallelstoreBackend(f"pstore://{root}", mountinfo=info, environ={"LD_PRELOAD": "/usr/lib64/libpil4dfs.so"})
    assert b2.diagnostics()["interception"] == "libpil4dfs" and b2.diagnostics()["hint"] is None
    assert detect_scheme(str(root / "run"), info) == "pstore"
    assert detect_scheme(str(tmp_path / "elsewhere"), info) == "file"


def test_parallelstore_fans_out_and_commits_without_hard_links(tmp_path, monkeypatch):
    def no_links(*a, **k):
        raise OSError(1, "dfuse has no hard links")

    monkeypatch.setattr(os, "link", no_links)
    url = f"pstore://{tmp_path / 'run'}"
    state = {f"w{i}": np.full(1 << 16, i, np.float32) for i in range(8)}
    cfg = ckptio.EngineConfig()
    b = ParallelstoreBackend(url, object_size=1 << 18)
    ckptio.save(url, state, step=1, backend=b, engine_config=cfg).result()
    subdirs = sorted(p.name for p in (tmp_path / "run" / "1").iterdir() if p.is_dir())
    assert len(subdirs) >= 4 and all(s.startswith("d") for s in subdirs)
    out = ckptio.restore(url, backend=ParallelstoreBackend(url))
    assert all((out[k] == v).all() for k, v in state.items())
    with pytest.raises(FileExistsError):
        ckptio.save(url, state, step=1, backend=ParallelstoreBackend(url))


READER = r"""
import sys, numpy as np, ckptio
url, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
full = np.arange(96 * 40, dtype=np.float32).reshape(96, 40)
# Each reader its own sharding: rank r takes column block r of n, plus a row block.
cols = (slice(None), slice(rank * 40 // n, (rank + 1) * 40 // n))
rows = (slice(rank * 7, rank * 7 + 13), slice(None))
t = {"w": ckptio.Sharded(full.shape, full.dtype, [(cols, None), (rows, None)]), "step": None}
out = ckptio.restore(url, target=t)
for ix, data in out["w"].pieces:
    assert data.tobytes() == np.ascontiguousarray(full[ix]).tobytes(), (rank, ix)
assert out["step"] == 5
print("ok", rank)
"""


@pytest.mark.slow
def test_many_readers_restore_from_a_read_only_view(read_only_mount):  # noqa: F811
    src, mnt = read_only_mount
    full = np.arange(96 * 40, dtype=np.float32).reshape(96, 40)
    writer_url = f"hdml://{src}/run"
    ckptio.save(writer_url, {"w": full, "step": 5}, step=5).result()
    writer = HyperdiskMLBackend(writer_url)
    asyncio.run(publish(writer, "5"))
    assert asyncio.run(is_published(writer, "5"))
    # The readers' view: read-only, auto-detected from the mount.
    reader = open_backend(str(mnt / "run"))
    assert isinstance(reader, HyperdiskMLBackend) and reader.capabilities.read_only
    with pytest.raises(PermissionError, match="read-only"):
        ckptio.save(str(mnt / "run"), {"w": full}, step=6).result()
    n = 4
    procs = [subprocess.Popen([sys.executable, "-c", READER, f"hdml://{mnt}/run", str(r), str(n)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(n)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs


def test_publish_refuses_a_corrupt_checkpoint(tmp_path):
    url = f"hdml://{tmp_path}/run"
    ckptio.save(url, {"w": np.arange(1000.0)}, step=1).result()
    [obj] = [p for p in (tmp_path / "run" / "1").iterdir() if p.name.endswith("-00000")]
    data = bytearray(obj.read_bytes())
    data[100] ^= 1
    obj.write_bytes(bytes(data))
    b = HyperdiskMLBackend(url)
    with pytest.raises(ckptio.IntegrityError, match="'w'"):
        asyncio.run(publish(b, "1"))
    assert not asyncio.run(is_published(b, "1"))
