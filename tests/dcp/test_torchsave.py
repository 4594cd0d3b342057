"""Stock torch reads checkpoints ckptio.dcp.Writer wrote on a local path (issue 36).

Stock ``FileSystemReader`` + ``dcp.load`` and ``format_utils.dcp_to_torch_save``
read them bit-exact (every dtype, byte items, empty tensors, a resharded load);
ckptio's commit rules still decide: ``.metadata`` is written after the
manifest, replaced with it, and deleted (only when its bytes are the ones
ckptio recorded) before any object it names. A checkpoint without
``.metadata`` (written by an older ckptio, or ``torch_readable=False``)
still loads through ckptio. The 2-rank gloo cases are in
tests/dcp/test_dcp_multiprocess.py.
"""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from tests.dcp.test_dcp import _quiet  # noqa: F401 -- an autouse fixture
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptio
from ckptio.backends._posix import aligned_buffer
from ckptio.dcp import Reader, Writer
from ckptio.dcp._torchsave import Record, frame, pack_records
from ckptio.engine import run_sync
from ckptio.store import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(64, 48, generator=g),
        "bf": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "c32": torch.randn(4, generator=g, dtype=torch.complex64).to(torch.complex32),
        "u16": torch.arange(11, dtype=torch.int32).to(torch.uint16),
        "mask": torch.arange(6) % 2 == 0,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "step": 100,
        "cfg": ["lr", 0.1],  # a byte item (DCP torch.saves it)
    }


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)() for k, v in sd.items()}


def _dcp_metadata(path: str) -> dict:
    store = CheckpointStore(path)
    try:
        return run_sync(store.read_manifest("")).metadata["dcp"]
    finally:
        run_sync(store.close())


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and b[k].shape == v.shape, k
            assert torch.equal(b[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        else:
            assert b[k] == v, k


@pytest.mark.parametrize("shape", [(0,), (3,), (5, 7), (1 << 16,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.complex32, torch.bool])
def test_a_framed_chunk_is_a_torch_save_record(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    t.reshape(-1).view(torch.uint8).copy_(torch.arange(t.nbytes, dtype=torch.int64).to(torch.uint8) % 2
                                          if dtype == torch.bool else torch.arange(t.nbytes).to(torch.uint8))
    head, tail = frame(dtype, shape)
    record = head + t.reshape(-1).view(torch.uint8).numpy().tobytes() + tail
    if t.nbytes:
        assert len(head) % 64 == 0  # the raw bytes stay aligned in the object
    back = torch.load(io.BytesIO(record), weights_only=True)
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_a_chunk_over_4_gib_gets_torchs_zip64_frame(tmp_path):
    """torch's own writer makes the frame, zip64 included; checked on a sparse file (nothing is allocated)."""
    n = (4 << 30) + 3 * 4096 + 8
    head, tail = frame(torch.uint8, (n,))
    path = tmp_path / "big.pt"
    with open(path, "wb") as f:
        f.write(head)
        f.seek(len(head) + n - 4)
        f.write(b"\x01\x02\x03\x04")
        f.write(tail)
    t = torch.load(path, mmap=True, weights_only=True)
    assert tuple(t.shape) == (n,) and t[-4:].tolist() == [1, 2, 3, 4] and t[:4].tolist() == [0, 0, 0, 0]


def test_records_are_never_split_and_start_aligned():
    recs = [Record(i, memoryview(bytes(n)), b"h" * 64, b"t" * 9) for i, n in enumerate([10, 3000, 50, 9000, 1])]
    plans, where = pack_records(recs, 4096, lambda n: f"obj{n}")
    assert sorted(where) == list(range(5))
    for i, (key, at, n) in where.items():
        assert at % 64 == 0 and n == recs[i].length
        plan = next(p for p in plans if p.key == key)
        assert at + n <= plan.size  # the whole record lies in one object
    assert where[3][1] == 0  # larger than the object size: an object of its own, whole
    # Direct IO: a large chunk's bytes start aligned (staged, page-aligned memory), and the frames before
    # them are aligned memory.
    big = 1 << 16
    plans, where = pack_records([Record(0, aligned_buffer(big), b"h" * 128, b"t" * 9),
                                 Record(1, aligned_buffer(big), b"h" * 128, b"t" * 9),
                                 Record(2, memoryview(bytes(4096)), b"h" * 128, b"t" * 9)], 1 << 20,
                                lambda n: f"obj{n}", align=4096)
    (plan,) = plans
    data = [e for e in plan.extents if e.item != "frame"]
    assert [e.offset % 4096 for e in data[:2]] == [0, 0]
    assert where[2][1] - (where[1][1] + where[1][2]) < 64  # a small chunk is not padded to a page
    frames = [e for e in plan.extents if e.item == "frame"]
    assert frames[0].offset == 0 and frames[0].length == 4096 and frames[0].data.obj.ctypes.data % 4096 == 0
    assert all(at % 64 == 0 for _, at, _ in where.values())
    # A sync dcp.save's tensors, not page-aligned (torch's own: 64-aligned; numpy's, shared by torch.from_numpy:
    # 16): their bytes at offsets in step with their memory (only their partial pages are bounced).
    tensors = [torch.arange(1 << 18, dtype=torch.float32) + i for i in range(2)]
    for _ in range(2):
        raw = np.empty((4 << 18) + 64, np.uint8)
        at = -raw.ctypes.data % 64 + 16  # 16 past a 64-byte boundary, as numpy's allocations often are
        tensors.append(torch.from_numpy(raw[at : at + (4 << 18)].view(np.float32)))
    assert any(t.data_ptr() % 64 for t in tensors) and all(t.data_ptr() % 16 == 0 for t in tensors)
    plans, where = pack_records([Record(i, memoryview(t.numpy()).cast("B"), b"h" * 128, b"t" * 9)
                                 for i, t in enumerate(tensors)], 8 << 20, lambda n: f"obj{n}", align=4096)
    (plan,) = plans
    data = [e for e in plan.extents if e.item != "frame"]
    assert [e.offset % 4096 for e in data] == [t.data_ptr() % 4096 for t in tensors]
    for i, (_key, at, n) in where.items():  # each record whole: its head, then its data, then its tail
        assert at + 128 == data[i].offset and n == 128 + (1 << 20) + 9
    spans = sorted((at, at + n) for _key, at, n in where.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_chunks_that_fill_an_object_by_their_data_share_it_despite_their_frames():
    # 32 chunks of 8 MiB under direct IO (page-aligned data, a frame before each): four 64 MiB objects, as DCP
    # itself writes four files, not 7 + 7 + 7 + 7 + 4 chunks in five (frames and padding past the object size).
    from ckptio.dcp._torchsave import FRAME_SLACK

    chunk, object_size = 8 << 20, 64 << 20
    head, tail = frame(torch.float32, (chunk // 4,))
    data = memoryview(bytes(chunk))
    plans, where = pack_records([Record(i, data, head, tail) for i in range(32)], object_size, lambda n: f"obj{n}",
                                align=4096)
    assert [sum(e.item != "frame" for e in p.extents) for p in plans] == [8, 8, 8, 8]
    assert all(p.size <= object_size + object_size // FRAME_SLACK for p in plans)
    assert sorted(where) == list(range(32))
    # Nine chunks' worth never shares one object: the slack is for frames, not for data.
    plans, _ = pack_records([Record(i, memoryview(bytes(1 << 20)), head, tail) for i in range(9)], 8 << 20,
                            lambda n: f"obj{n}", align=4096)
    assert [sum(e.item != "frame" for e in p.extents) for p in plans] == [8, 1]


def test_stock_torch_reads_a_ckptio_checkpoint_bit_exact(tmp_path):
    sd = _state()
    path = str(tmp_path / "ck")
    dcp.save(sd, storage_writer=Writer(path))
    assert ".metadata" in os.listdir(path)
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(path))
    _same(sd, out)
    dcp.load(out := _zeros_like(sd), checkpoint_id=path)  # no storage_reader: torch picks FileSystemReader
    _same(sd, out)
    # What PyTorch's own format_utils test does, with the checkpoint written through ckptio.
    dcp_to_torch_save(path, tmp_path / "model.pt")
    _same(sd, torch.load(tmp_path / "model.pt", weights_only=False))
    # ckptio's readers read the same checkpoint from its manifest (the .metadata is never read by ckptio).
    dcp.load(out := _zeros_like(sd), storage_reader=Reader(path))
    _same(sd, out)
    native = ckptio.restore(path)
    assert np.array_equal(native["w"], sd["w"].numpy())


def test_a_resharded_stock_load_reads_a_part(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan

    sd = {"w": torch.arange(4096.0).reshape(64, 64)}
    dcp.save(sd, storage_writer=Writer(tmp_path / "ck"))
    rows = torch.zeros(16, 64)  # rows 32..47 only: a planner that narrows the saved chunk

    class Narrow(dcp.DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

            md = self.metadata.state_dict_metadata["w"]
            want = ChunkStorageMetadata(offsets=torch.Size([32, 0]), sizes=torch.Size([16, 64]))
            return LoadPlan(create_read_items_for_chunk_list("w", md, [want]))

        def resolve_tensor(self, read_item):
            return rows

        def commit_tensor(self, read_item, tensor):
            pass

    dcp.load({"w": rows}, storage_reader=FileSystemReader(str(tmp_path / "ck")), planner=Narrow())
    assert torch.equal(rows, sd["w"][32:48])


def test_managed_steps_are_torch_readable_and_deletion_takes_the_metadata(tmp_path):
    root = str(tmp_path / "run")
    sd = {"w": torch.arange(10.0)}
    for step in (1, 2):
        dcp.save(sd, storage_writer=Writer(root, step=step))
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=FileSystemReader(os.path.join(root, "2")))
    assert torch.equal(out["w"], sd["w"])
    with ckptio.CheckpointManager(root, max_to_keep=1) as mngr:
        mngr.delete(1)
    assert not os.path.exists(os.path.join(root, "1", ".metadata"))
    assert ".metadata" in os.listdir(os.path.join(root, "2"))


def test_deletion_leaves_a_metadata_that_is_not_the_one_ckptio_wrote(tmp_path):
    root = str(tmp_path / "run")
    dcp.save({"w": torch.arange(3.0)}, storage_writer=Writer(root, step=5))
    meta = os.path.join(root, "5", ".metadata")
    with open(meta, "wb") as f:
        f.write(b"someone else's file")
    with ckptio.CheckpointManager(root) as mngr:
        mngr.delete(5)
    assert open(meta, "rb").read() == b"someone else's file"  # not provably ckptio's: left alone
    assert not os.path.exists(os.path.join(root, "5", "ckptio.manifest.json"))


def test_replacing_keeps_stock_reads_consistent(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.zeros(8)}, storage_writer=Writer(path))
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(path))  # overwrite=True: replaced in place
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert torch.equal(out["w"], torch.ones(8))
    # Replaced by a save that is not torch-readable: the old .metadata (naming deleted objects) goes first.
    dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=Writer(path, torch_readable=False))
    assert ".metadata" not in os.listdir(path)
    dcp.load(out, storage_reader=Reader(path))
    assert torch.equal(out["w"], torch.full((8,), 2.0))


def test_a_checkpoint_without_metadata_still_loads_through_ckptio(tmp_path):
    sd = _state()
    path = str(tmp_path / "old")
    dcp.save(sd, storage_writer=Writer(path, torch_readable=False))  # as ckptio wrote before issue 36
    assert ".metadata" not in os.listdir(path)
    assert "companions" not in _dcp_metadata(path)
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=Reader(path))
    _same(sd, out)


def test_the_metadata_is_the_only_pickle_and_ckptio_records_it(tmp_path):
    import hashlib

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.arange(4.0)}, storage_writer=Writer(path))
    data = open(os.path.join(path, ".metadata"), "rb").read()
    assert _dcp_metadata(path)["companions"] == [
        {"name": ".metadata", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}]
    md = pickle.loads(data)
    (info,) = md.storage_data.values()
    assert not os.path.isabs(info.relative_path) and os.path.isfile(os.path.join(path, info.relative_path))


def test_torch_readable_true_is_refused_where_torch_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="mem://x"):
        Writer("mem://x", torch_readable=True)
    assert not Writer("mem://x").torch_readable
    from torch.distributed.checkpoint._extension import ZStandard

    pytest.importorskip("zstandard")
    with pytest.raises(ValueError, match="_extensions"):
        Writer(tmp_path, torch_readable=True, _extensions=[ZStandard()])
    assert not Writer(tmp_path, _extensions=[ZStandard()]).torch_readable


def test_a_failed_metadata_write_leaves_a_committed_checkpoint_torch_does_not_misread(tmp_path, monkeypatch):
    from ckptio.backends.local import LocalBackend

    real, real_create = LocalBackend.write, LocalBackend.create_if_absent

    async def no_metadata(self, key, buffers, *a, **kw):
        if key.endswith(".metadata"):
            raise OSError(28, "No space left on device")
        return await real(self, key, buffers, *a, **kw)

    async def no_new_metadata(self, key, data, *a, **kw):  # a step's .metadata is created, not overwritten
        if key.endswith(".metadata"):
            raise OSError(28, "No space left on device")
        return await real_create(self, key, data, *a, **kw)

    path = str(tmp_path / "ck")
    dcp.save({"w": torch.zeros(8)}, storage_writer=Writer(path))
    monkeypatch.setattr(LocalBackend, "write", no_metadata)
    monkeypatch.setattr(LocalBackend, "create_if_absent", no_new_metadata)
    root = str(tmp_path / "run")
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(root, step=1))  # committed; logged, not raised
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(path))  # replaces: the old .metadata must go
    monkeypatch.undo()
    assert ".metadata" not in os.listdir(os.path.join(root, "1")) and ".metadata" not in os.listdir(path)
    for reader in (Reader(root, step=1), Reader(path)):  # committed: ckptio reads both
        out = {"w": torch.zeros(8)}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], torch.ones(8))


def test_a_float32_save_does_not_import_ml_dtypes(tmp_path):
    # Its import takes 1.4-4 s on this host: it must not sit inside the first save's stall when no tensor needs it.
    import subprocess
    import sys

    code = ("import sys, torch, torch.distributed.checkpoint as dcp, ckptio; from ckptio.dcp import Writer\n"
            f"sd = {{'w': torch.arange(6, dtype=torch.float32)}}\n"
            f"ckptio.save({str(tmp_path / 'native')!r}, sd, step=1).result()\n"
            f"dcp.save(sd, storage_writer=Writer({str(tmp_path / 'dcp')!r}))\n"
            "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
