"""Hyperdisk ML and Parallelstore: conformance, mount detection, read-only phase, many readers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backend_conformance import BackendConformance
from test_backend_local import read_only_mount  # noqa: F401  (a fixture)

import ckptio
from ckptio.backends import detect_scheme, open_backend
from ckptio.backends.base import Backend
from ckptio.backends.hyperdisk_ml import HyperdiskMLBackend, is_published, publish
from ckptio.backends.parallelstore import ParallelstoreBackend


class TestHyperdiskML(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return HyperdiskMLBackend(str(tmp_path / "root"))


class TestParallelstore(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return ParallelstoreBackend(str(tmp_path / "root"))


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
