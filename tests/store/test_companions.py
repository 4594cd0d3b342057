"""``ckptio cp`` of a step ``ckptio.dcp.Writer`` wrote carries DCP's ``.metadata`` (issue 36).

The copy stays readable by stock torch (``FileSystemReader``, ``dcp_to_torch_save``)
on its own, with the source gone; its manifest records the file (so deletion
at the destination takes it, and only it); where the objects would not keep
their names (a hashed store) the copy's manifest records no companion; a
``.metadata`` ckptio did not write at the destination is never overwritten.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from tests.dcp.test_dcp import _quiet  # noqa: F401 -- an autouse fixture
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptio
import ckptio.cli
from ckptio.dcp import Reader, Writer
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.manage.copying import copy_checkpoint
from ckptio.store import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 48, generator=g), "bf": torch.randn(9, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 3), "step": 30, "cfg": ["lr", 0.1]}


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)() for k, v in sd.items()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and torch.equal(b[k].view(torch.uint8), v.view(torch.uint8)), k
        else:
            assert b[k] == v, k


def _companions(url: str, step_dir: str) -> list[dict]:
    store = CheckpointStore(url)
    try:
        return run_sync(store.read_manifest(step_dir)).metadata["dcp"].get("companions", [])
    finally:
        run_sync(store.close())


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("dst_step", [None, 9])
def test_a_copy_is_read_by_stock_torch_without_its_source(tmp_path, dst_step):
    sd = _state()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(sd, storage_writer=Writer(src, step=30))
    argv = ["cp", src, dst] + ([] if dst_step is None else ["--dst-step", str(dst_step)])
    assert ckptio.cli.main(argv) == 0
    shutil.rmtree(src)  # the copy's .metadata must name the copy's objects, not the source's
    step = os.path.join(dst, str(dst_step or 30))
    meta = os.path.join(step, ".metadata")
    assert _companions(dst, str(dst_step or 30)) == [
        {"name": ".metadata", "size": os.path.getsize(meta), "sha256": _sha(meta)}]
    dcp.load(out := _zeros_like(sd), storage_reader=FileSystemReader(step))
    _same(sd, out)
    dcp_to_torch_save(step, tmp_path / "model.pt")
    _same(sd, torch.load(tmp_path / "model.pt", weights_only=False))
    dcp.load(out := _zeros_like(sd), storage_reader=Reader(dst, step=dst_step or 30))
    _same(sd, out)


def test_deleting_the_copy_takes_its_metadata(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(_state(), storage_writer=Writer(src, step=1))
    assert ckptio.cli.main(["cp", src, dst]) == 0
    with ckptio.CheckpointManager(dst) as mngr:
        mngr.delete(1)
    assert not os.path.exists(os.path.join(dst, "1")) or os.listdir(os.path.join(dst, "1")) == []
    assert ".metadata" in os.listdir(os.path.join(src, "1"))  # the source is untouched


def test_a_copy_that_died_after_its_commit_gets_its_metadata_on_the_rerun(tmp_path):
    sd = _state()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(sd, storage_writer=Writer(src, step=4))
    assert ckptio.cli.main(["cp", src, dst]) == 0
    os.remove(os.path.join(dst, "4", ".metadata"))  # as if the copy died between its commit and this file
    assert ckptio.cli.main(["cp", src, dst]) == 0  # already complete: only the file is written
    dcp.load(out := _zeros_like(sd), storage_reader=FileSystemReader(os.path.join(dst, "4")))
    _same(sd, out)


def test_a_metadata_ckptio_did_not_write_at_the_destination_is_left_and_nothing_commits(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(_state(), storage_writer=Writer(src, step=2))
    os.makedirs(os.path.join(dst, "2"))
    with open(os.path.join(dst, "2", ".metadata"), "wb") as f:
        f.write(b"a stock DCP checkpoint's")
    assert ckptio.cli.main(["cp", src, dst]) != 0
    assert open(os.path.join(dst, "2", ".metadata"), "rb").read() == b"a stock DCP checkpoint's"
    assert "ckptio.manifest.json" not in os.listdir(os.path.join(dst, "2"))


def test_a_copy_whose_objects_are_renamed_records_no_metadata(tmp_path):
    sd = _state()
    src = str(tmp_path / "src")
    dcp.save(sd, storage_writer=Writer(src, step=3))
    dst = str(tmp_path / "dst")
    # Hashed names, as on an object store: the objects leave the step directory.
    a, b = CheckpointStore(src), CheckpointStore(dst, naming=HashedNaming())
    try:
        out, _ = run_sync(copy_checkpoint(a, b, "3"))
        assert "companions" not in out.metadata["dcp"] and not any(k.startswith("3/") for k in out.objects)
        assert not os.path.exists(os.path.join(dst, "3", ".metadata"))
        assert _companions(dst, "3") == []
        dcp.load(got := _zeros_like(sd), storage_reader=Reader(dst, step=3))
        _same(sd, got)
    finally:
        run_sync(a.close())
        run_sync(b.close())


def test_a_source_metadata_that_is_not_ours_is_not_carried(tmp_path):
    sd = _state()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(sd, storage_writer=Writer(src, step=5))
    with open(os.path.join(src, "5", ".metadata"), "wb") as f:
        f.write(b"overwritten by someone")
    assert ckptio.cli.main(["cp", src, dst]) == 0
    assert ".metadata" not in os.listdir(os.path.join(dst, "5")) and _companions(dst, "5") == []
    dcp.load(out := _zeros_like(sd), storage_reader=Reader(dst, step=5))  # ckptio reads the copy all the same
    _same(sd, out)


def test_a_copy_paused_after_its_commit_never_overwrites_a_newer_checkpoints_metadata(tmp_path, monkeypatch):
    """A cp paused between its commit and its ``.metadata`` wakes after its step was deleted and saved
    again (a Writer's new checkpoint, with a ``.metadata`` of its own): the stale bytes must not replace
    the new checkpoint's, which stock torch goes on reading."""
    import asyncio

    import ckptio.manage.copying as copy_mod

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    dcp.save(_state(), storage_writer=Writer(src, step=6))
    newer = {"w": torch.arange(12.0).reshape(3, 4), "step": 60}
    real = copy_mod.write_companions

    def meanwhile() -> None:
        with ckptio.CheckpointManager(dst) as m:
            m.delete(6)
        dcp.save(newer, storage_writer=Writer(dst, step=6))

    async def paused(store, step_dir, companions):
        await asyncio.to_thread(meanwhile)  # the copy sleeps; the step goes and comes back
        await real(store, step_dir, companions)

    monkeypatch.setattr(copy_mod, "write_companions", paused)
    a, b = CheckpointStore(src), CheckpointStore(dst)
    try:
        run_sync(copy_checkpoint(a, b, "6"))
    finally:
        run_sync(a.close())
        run_sync(b.close())
    meta = os.path.join(dst, "6", ".metadata")
    assert _companions(dst, "6") == [{"name": ".metadata", "size": os.path.getsize(meta), "sha256": _sha(meta)}]
    dcp.load(out := _zeros_like(newer), storage_reader=FileSystemReader(os.path.join(dst, "6")))
    _same(newer, out)


def test_a_writer_paused_after_its_commit_never_overwrites_a_newer_checkpoints_metadata(tmp_path, monkeypatch):
    """The Writer's own window, as the copy's above: it commits step 7, pauses before its ``.metadata``;
    the step is deleted and saved again by another Writer; the first one's late file must not replace
    the newer checkpoint's."""
    import asyncio

    import ckptio.dcp._overwrite as overwrite

    root = str(tmp_path / "r")
    newer = {"w": torch.arange(12.0).reshape(3, 4), "step": 70}
    real = overwrite.write_companion
    paused: list[bool] = []

    def meanwhile() -> None:
        with ckptio.CheckpointManager(root) as m:
            m.delete(7)
        dcp.save(newer, storage_writer=Writer(root, step=7))

    async def pause_once(store, step_dir, data, **kw):
        if not paused:
            paused.append(True)
            await asyncio.to_thread(meanwhile)  # the first writer sleeps; its step goes and comes back
        return await real(store, step_dir, data, **kw)

    monkeypatch.setattr(overwrite, "write_companion", pause_once)
    dcp.save(_state(), storage_writer=Writer(root, step=7))
    meta = os.path.join(root, "7", ".metadata")
    assert paused and _companions(root, "7") == [
        {"name": ".metadata", "size": os.path.getsize(meta), "sha256": _sha(meta)}]
    dcp.load(out := _zeros_like(newer), storage_reader=FileSystemReader(os.path.join(root, "7")))
    _same(newer, out)
