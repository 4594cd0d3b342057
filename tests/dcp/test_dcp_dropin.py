"""ckptio.dcp as a drop-in for FileSystemWriter / FileSystemReader (issue 18).

The path is the checkpoint (``overwrite`` both ways, ``checkpoint_id=`` with
one writer), replacing never leaves the path without a restorable
checkpoint nor deletes what is not provably an orphan, stock DCP
checkpoints load through ckptio.dcp.Reader (ranged, resharded, transformed),
``_extensions`` / ``thread_count`` / ``cache_staged_state_dict`` are honoured,
and every dtype torch can put in a DCP checkpoint round-trips.
Multi-process resharding of stock checkpoints (local and fake GCS) is in
tests/dcp/test_dcp_multiprocess.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from tests.dcp.test_dcp import (  # noqa: F401 -- _quiet: an autouse fixture
    _bits,
    _Planner,
    _quiet,
    _random,
    _read,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

import ckptio
from ckptio.backends.memory import MemoryBackend
from ckptio.dcp import Reader, Writer
from ckptio.engine import Engine, run_sync
from ckptio.manifest.names import parse_object
from ckptio.store import CheckpointStore

pytestmark = pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized


def _objects(url: str) -> set[str]:
    """Every ckptio data object under a local or mem:// root."""
    store = CheckpointStore(url)
    try:
        return {i.key for i in run_sync(store.backend.list("")) if parse_object(i.key)}
    finally:
        run_sync(store.close())


def _manifest_objects(url: str) -> set[str]:
    store = CheckpointStore(url)
    try:
        return set(run_sync(store.read_manifest("")).objects)
    finally:
        run_sync(store.close())


def _load(url: str, like: dict, **kw) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)() for k, v in like.items()}
    dcp.load(out, storage_reader=Reader(url, **kw))
    return out


@pytest.fixture(params=["local", "mem"])
def url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ck")
    else:
        u = f"mem://dcp-dropin-{os.getpid()}-{request.node.name}"
        yield u
        MemoryBackend.forget(u)


# -- the path is the checkpoint ------------------------------------------------


def test_save_twice_to_one_path_overwrite_true_replaces_and_cleans(url):
    a = {"w": torch.arange(1000.0), "step": 1}
    b = {"w": -torch.arange(1000.0), "step": 2}
    dcp.save(a, storage_writer=Writer(url, overwrite=False))  # nothing there yet: overwrite=False is fine
    first = _manifest_objects(url)
    dcp.save(b, storage_writer=Writer(url))  # FileSystemWriter's default: overwrite=True
    got = _load(url, b)
    assert torch.equal(got["w"], b["w"]) and got["step"] == 2
    second = _manifest_objects(url)
    # The old checkpoint's objects are gone, the new one's all there, nothing else of ours is left.
    assert first and second and not first & second
    assert _objects(url) == second
    assert ckptio.restore(url)["w"].tolist() == b["w"].tolist()  # and it is a native checkpoint too


@pytest.mark.parametrize("damaged", [False, True])
def test_replacing_a_multi_host_checkpoint_deletes_every_object_its_fragments_name(url, damaged):
    # Format 2: the root manifest names no objects; the replaced checkpoint's are in its fragments.
    from hosts import on_hosts

    rows = np.arange(64.0).reshape(8, 8)
    on_hosts(2, lambda rank, coord: ckptio.save(url, {"w": ckptio.Sharded(
        rows.shape, rows.dtype, [((slice(4 * rank, 4 * rank + 4),), rows[4 * rank:4 * rank + 4])])},
        coordinator=coord).result())
    first = _objects(url)
    assert len([k for k in first if "fragment" in k]) == 2 and len(first) == 4
    store = CheckpointStore(url)
    if damaged:  # a fragment that proves nothing: its checkpoint's objects are left to gc
        key = sorted(k for k in first if "fragment" in k)[0]
        data = bytearray(run_sync(store.backend.read(key)))
        data[len(data) // 2] ^= 1
        run_sync(store.backend.write(key, [memoryview(bytes(data))]))
    b = {"w": -torch.arange(1000.0), "step": 2}
    dcp.save(b, storage_writer=Writer(url))
    assert torch.equal(_load(url, b)["w"], b["w"])
    if damaged:
        assert first < _objects(url)
        run_sync(store.sweep(0))  # gc proves them orphans: no manifest names them any more
    run_sync(store.close())
    assert _objects(url) == _manifest_objects(url) and not first & _objects(url)


def test_save_twice_overwrite_false_raises_dcps_error_and_keeps_the_first(url):
    a = {"w": torch.ones(4)}
    dcp.save(a, storage_writer=Writer(url))
    before = _objects(url)
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        dcp.save({"w": torch.zeros(4)}, storage_writer=Writer(url, overwrite=False))
    assert url in str(info.value)
    assert torch.equal(_load(url, a)["w"], torch.ones(4)) and _objects(url) == before


def test_one_writer_across_saves_with_checkpoint_id(tmp_path):
    w = Writer(tmp_path / "unused")  # DCP's reset(checkpoint_id) moves it
    r = Reader(tmp_path / "unused")
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for i, p in enumerate(paths):
        dcp.save({"w": torch.full((3,), float(i))}, storage_writer=w, checkpoint_id=p)
    dcp.save({"w": torch.full((3,), 7.0)}, storage_writer=w, checkpoint_id=paths[0])  # the same writer, again: replaces
    for p, want in zip(paths, (7.0, 1.0)):
        out = {"w": torch.zeros(3)}
        dcp.load(out, storage_reader=r, checkpoint_id=p)
        assert out["w"].tolist() == [want] * 3, p
    assert not os.path.exists(tmp_path / "unused")
    assert len(_objects(paths[0])) == len(_manifest_objects(paths[0]))  # the replaced save's objects went


def test_a_step_of_a_managed_root_is_still_never_overwritten(tmp_path):
    root = str(tmp_path / "run")
    late = Writer(root, step=5)  # made before step 5 is committed
    dcp.save({"w": torch.ones(2)}, storage_writer=Writer(root, step=5))
    with pytest.raises(FileExistsError) as e:  # overwrite=True does not apply
        Writer(root, step=5)  # refused in the caller's code: one line, not torch's per-rank tracebacks
    assert "\n" not in str(e.value) and f"step 5 of {root} is already committed" in str(e.value)
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=late)  # committed since: still refused, inside torch
    out = {"w": torch.zeros(2)}
    dcp.load(out, storage_reader=Reader(root, step=5))
    assert out["w"].tolist() == [1.0, 1.0]


def test_a_writer_at_a_regular_file_names_it(tmp_path):
    # Issue 16: was a CheckpointException wrapping "FileNotFoundError ... writing 'ckptio.intent...'".
    f = tmp_path / "afile"
    f.write_bytes(b"not a checkpoint")
    for make in (lambda: Writer(f), lambda: Writer(f, step=3), lambda: Writer(f / "under")):
        with pytest.raises(NotADirectoryError, match=f"{f}.* is a file, not a directory|lies under {f}, which is a file"):
            make()
    with pytest.raises(NotADirectoryError, match=f"{f} is a file, not a directory"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(f), storage_writer=Writer(tmp_path / "ok"))  # via reset()
    assert f.read_bytes() == b"not a checkpoint" and not (tmp_path / "ok").exists()


def test_a_stock_checkpoint_is_neither_deleted_nor_shadowed(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path))
    files = sorted(os.listdir(path))
    with pytest.raises(CheckpointException, match="holds a stock DCP checkpoint"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=Writer(path))
    assert sorted(os.listdir(path)) == files
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=Writer(path, overwrite=False))


# -- replacing is crash-safe and deletes only provable orphans ---------------------


class _Crash(BaseException):
    """A process dying at a chosen point (not an Exception: nothing may swallow it)."""


def test_crash_after_the_new_manifest_leaves_it_restorable_and_only_provable_orphans(url, monkeypatch):
    from ckptio.dcp import _overwrite

    a, b = {"w": torch.arange(64.0)}, {"w": torch.arange(64.0) * 3}
    dcp.save(a, storage_writer=Writer(url))
    old = _manifest_objects(url)

    async def crash(*args, **kwargs):
        raise _Crash

    monkeypatch.setattr(_overwrite, "_delete_replaced", crash)
    with pytest.raises(CheckpointException, match="_Crash"):
        dcp.save(b, storage_writer=Writer(url))
    monkeypatch.undo()
    new = _manifest_objects(url)
    assert torch.equal(_load(url, b)["w"], b["w"])  # the new checkpoint is committed and complete
    assert _objects(url) == old | new  # the old objects are still there, as orphans
    store = CheckpointStore(url)
    report = run_sync(store.sweep(grace_seconds=0))
    run_sync(store.close())
    assert set(report.objects) == old  # gc proves exactly those are orphans
    assert _objects(url) == new and torch.equal(_load(url, b)["w"], b["w"])


def test_crash_before_the_new_manifest_keeps_the_old_checkpoint(url, monkeypatch):
    from ckptio.dcp import _overwrite

    a, b = {"w": torch.arange(64.0)}, {"w": torch.arange(64.0) * 3}
    dcp.save(a, storage_writer=Writer(url))
    old = _manifest_objects(url)
    real = _overwrite.replace

    async def crash_before_write(store, step_dir, manifest, *companion):
        await store.check_objects(manifest, "test")  # the new objects are all written ...
        raise _Crash  # ... and the process dies before the manifest

    monkeypatch.setattr(_overwrite, "replace", crash_before_write)
    with pytest.raises(CheckpointException, match="_Crash"):
        dcp.save(b, storage_writer=Writer(url))
    monkeypatch.setattr(_overwrite, "replace", real)
    assert torch.equal(_load(url, a)["w"], a["w"]) and _manifest_objects(url) == old
    store = CheckpointStore(url)
    run_sync(store.sweep(grace_seconds=0))
    run_sync(store.close())
    assert _objects(url) == old and torch.equal(_load(url, a)["w"], a["w"])


def test_replacing_spares_live_saves_foreign_files_and_the_new_objects(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(url))
    old = _manifest_objects(url)
    old_id = parse_object(next(iter(old))).save_id
    with open(os.path.join(url, "notes.txt"), "w") as f:
        f.write("mine")
    # A live save (say a copy keeping these names) covers the old objects: they must survive the replace.
    store = CheckpointStore(url)
    run_sync(store.announce("", "0123456789ab", covers=[old_id]))
    dcp.save({"w": torch.zeros(8)}, storage_writer=Writer(url))
    assert old <= _objects(url) and open(os.path.join(url, "notes.txt")).read() == "mine"
    run_sync(store.retire("", "0123456789ab"))
    dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=Writer(url))
    run_sync(store.sweep(grace_seconds=0))
    run_sync(store.close())
    assert _objects(url) == _manifest_objects(url) and os.path.exists(os.path.join(url, "notes.txt"))
    assert _load(url, {"w": torch.ones(8)})["w"].tolist() == [2.0] * 8


def test_replace_refuses_a_manifest_naming_a_missing_object(tmp_path):
    from ckptio.dcp import _overwrite

    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(8)}, storage_writer=Writer(url))
    store = CheckpointStore(url)
    good = run_sync(store.read_manifest(""))
    doc = good.to_doc()
    doc["objects"] = [k.replace(k[:12], "fedcba987654", 1) for k in doc["objects"]]  # objects nobody wrote
    bad = type(good).from_doc(doc, "test")
    with pytest.raises(FileNotFoundError, match="missing"):
        run_sync(_overwrite.replace(store, "", bad))
    run_sync(store.close())
    assert torch.equal(_load(url, {"w": torch.ones(8)})["w"], torch.ones(8))


# -- FileSystemWriter's options ----------------------------------------------------


def test_zstandard_extension_round_trips_and_is_recorded(url):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    sd = {"w": torch.zeros(256, 64), "r": _random((33, 5), torch.bfloat16, 1), "c": _random((4, 3), torch.complex32, 2),
          "meta": {"step": 9, "note": "z"}}
    dcp.save(sd, storage_writer=Writer(url, _extensions=[ZStandard()]))
    store = CheckpointStore(url)
    manifest = run_sync(store.read_manifest(""))
    run_sync(store.close())
    entry = manifest.metadata["dcp"]["items"]["w"]
    assert [c["transforms"] for c in entry["chunks"]] == [["stream.zstd/1"]]
    assert manifest.items[entry["item"]].nbytes < 256 * 64 * 4 // 10  # zeros compress: really compressed
    out = {"w": torch.ones(256, 64), "r": torch.zeros(33, 5, dtype=torch.bfloat16),
           "c": torch.zeros(4, 3, dtype=torch.complex32), "meta": {"step": 0, "note": ""}}
    dcp.load(out, storage_reader=Reader(url))
    assert torch.equal(out["w"], sd["w"]) and _bits(out["r"]) == _bits(sd["r"]) and _bits(out["c"]) == _bits(sd["c"])
    assert out["meta"] == {"step": 9, "note": "z"}
    # A native restore does not hand out compressed bytes as values.
    assert "w" not in ckptio.restore(url)


def test_extensions_are_checked_and_unknown_transforms_named(tmp_path):
    with pytest.raises(TypeError, match="StreamTransformExtension"):
        Writer(tmp_path / "x", _extensions=[object()])
    from ckptio.dcp import _transforms

    with pytest.raises(ValueError, match="stream.nope/1"):
        _transforms.undo(["stream.nope/1"], b"abc", None, "here")


def test_thread_count_cache_staged_and_serialization_format(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    w = Writer(tmp_path / "ck", thread_count=3, cache_staged_state_dict=True, single_file_per_rank=False,
               sync_files=True, serialization_format=SerializationFormat.TORCH_SAVE)
    assert w.engine_config.concurrency == 3 and w._open().engine.concurrency == 3
    w.close()
    with pytest.raises(ValueError, match="safetensors|SAFETENSORS"):
        Writer(tmp_path / "ck", serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="thread_count"):
        Writer(tmp_path / "ck", thread_count=0)
    sd = {"w": torch.arange(6.0)}
    dcp.async_save(sd, storage_writer=w).result()  # cache_staged_state_dict: staging reuses pooled buffers
    assert torch.equal(_load(str(tmp_path / "ck"), sd)["w"], sd["w"])


# -- dtypes ------------------------------------------------------------------------

# (The bits* dtypes torch.save can write, but DCP's own planner cannot size them: no DCP checkpoint holds one.)
RAW = ["complex32", "float4_e2m1fn_x2", "float8_e8m0fnu", "uint16", "uint32", "uint64"]


@pytest.mark.parametrize("name", [n for n in RAW if hasattr(torch, n)])
def test_every_torch_save_dtype_round_trips(url, name):
    dt = getattr(torch, name)
    sd = {"m": _random((5, 3), dt, 1), "s": _random((), dt, 2), "e": torch.empty(0, 4, dtype=dt)}
    dcp.save(sd, storage_writer=Writer(url))
    out = {k: torch.empty(v.shape, dtype=dt) for k, v in sd.items()}
    for v in out.values():
        v.reshape(-1).view(torch.uint8).fill_(0x5A)
    dcp.load(out, storage_reader=Reader(url))
    for k in sd:
        assert out[k].dtype == dt and out[k].shape == sd[k].shape and _bits(out[k]) == _bits(sd[k]), k
    # Sub-rectangles of a raw dtype are ranged reads too.
    reader = Reader(url)
    reader.read_metadata()
    tgt = torch.empty(2, 2, dtype=dt)
    reader.read_data(LoadPlan([_read("m", (1, 1), (2, 2), "t")]), _Planner({"t": tgt})).wait()
    assert _bits(tgt) == _bits(sd["m"][1:3, 1:3])


def test_an_unstorable_dtype_names_the_fqn(tmp_path):
    # DCP's own planner already fails on sub-byte shell dtypes (torch.save refuses them too); a custom
    # planner could still hand one to the writer, which must name the tensor.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ckptio.dcp.writer import _raw_bytes

    t = torch.zeros(4, dtype=torch.uint4) if hasattr(torch, "uint4") else pytest.skip("no torch.uint4")
    item = WriteItem(MetadataIndex("model.q", (0,)), WriteItemType.SHARD, tensor_data=TensorWriteData(
        ChunkStorageMetadata(torch.Size([0]), torch.Size([4])), TensorProperties(dtype=torch.uint4), torch.Size([4])))
    with pytest.raises(TypeError, match="'model.q'.*uint4"):
        _raw_bytes(item, t)


# -- stock DCP checkpoints -------------------------------------------------------


@pytest.fixture
def read_bytes(monkeypatch):
    """Bytes the engine is asked to read, by object key."""
    seen: dict[str, int] = {}
    real = Engine.read

    async def counting(self, requests, progress=None):
        for r in requests:
            seen[r.key] = seen.get(r.key, 0) + r.rng.length
        return await real(self, requests, progress)

    monkeypatch.setattr(Engine, "read", counting)
    return seen


def _ranged_read(url: str, read_bytes: dict[str, int], offsets: tuple[int, int], lengths: tuple[int, int]) -> bytes:
    """Read a box of the stock checkpoint's float32 "big" through the Reader; assert only a few KiB moved."""
    reader = Reader(url)
    key = reader.read_metadata().storage_data[MetadataIndex("big", (0, 0))].relative_path
    read_bytes.clear()
    tgt = torch.empty(lengths)
    reader.read_data(LoadPlan([_read("big", offsets, lengths, "x")]), _Planner({"x": tgt})).wait()
    assert 0 < read_bytes[key] < 64 << 10, read_bytes  # two 16 KiB probes and the box's rows, not 1.2 MB
    return _bits(tgt)


@pytest.mark.parametrize("single_file_per_rank", [True, False])
def test_stock_checkpoint_loads_through_reader(tmp_path, single_file_per_rank, read_bytes):
    path = str(tmp_path / "stock")
    big = torch.randn(1024, 300, generator=torch.Generator().manual_seed(3))
    sd = {"big": big, "t": big.t()[:7].clone().t(),  # a strided saved tensor
          "bf": _random((9, 4), torch.bfloat16, 4), "c32": _random((3, 3), torch.complex32, 5),
          "f4": _random((6,), torch.float4_e2m1fn_x2, 6), "s": torch.tensor(2.5),
          "meta": {"step": 3, "names": ["a", "b"]}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=single_file_per_rank, thread_count=2))
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "names": []} for k, v in sd.items()}
    dcp.load(out, storage_reader=Reader(path))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and out[k].shape == v.shape and _bits(out[k]) == _bits(v), k
    assert out["meta"] == sd["meta"]
    # A sub-rectangle of the big chunk: ranged reads of just its rows, not the 1.2 MB record.
    assert _ranged_read(path, read_bytes, (500, 200), (10, 50)) == _bits(big[500:510, 200:250])
    # The stock checkpoint's files are untouched, and a stock reader still reads them.
    again = {"big": torch.zeros(1024, 300)}
    dcp.load(again, storage_reader=dcp.FileSystemReader(path))
    assert torch.equal(again["big"], big)


def test_stock_checkpoint_with_zstandard_loads(tmp_path):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    path = str(tmp_path / "stockz")
    sd = {"w": torch.arange(4096.0).reshape(64, 64), "meta": {"k": 1}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, _extensions=[ZStandard()]))
    out = {"w": torch.zeros(64, 64), "meta": {"k": 0}}
    dcp.load(out, storage_reader=Reader(path))
    assert torch.equal(out["w"], sd["w"]) and out["meta"] == {"k": 1}
    reader = Reader(path)  # a sub-rectangle of a transformed record: read whole, undone, narrowed
    reader.read_metadata()
    tgt = torch.empty(3, 5)
    reader.read_data(LoadPlan([_read("w", (10, 20), (3, 5), "x")]), _Planner({"x": tgt})).wait()
    assert torch.equal(tgt, sd["w"][10:13, 20:25])


def test_stock_reading_can_be_refused_and_a_mixed_directory_is_named(tmp_path):
    path = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path))
    with pytest.raises(ckptio.ManifestError, match="allow_stock=False"):
        Reader(path, allow_stock=False).read_metadata()
    both = str(tmp_path / "both")
    dcp.save({"w": torch.ones(2)}, storage_writer=Writer(both))
    dcp.save({"w": torch.zeros(2)}, storage_writer=dcp.FileSystemWriter(both))  # stock saved over ckptio's
    with pytest.raises(ckptio.ManifestError, match="both"):
        Reader(both).read_metadata()


@pytest.mark.gcs
def test_stock_checkpoint_on_fake_gcs_loads_with_ranged_reads(gcs_emulator_env, tmp_path, read_bytes):
    path = str(tmp_path / "stock")
    big = torch.randn(1024, 300, generator=torch.Generator().manual_seed(8))
    sd = {"big": big, "meta": {"step": 4}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
    url = f"gs://ckptio-test/stock-{os.getpid()}"
    store = CheckpointStore(url)
    for name in os.listdir(path):  # where a user's old run lies: the stock files, as they are
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        run_sync(store.backend.write(name, [memoryview(data)]))
    run_sync(store.close())
    out = {"big": torch.zeros(1024, 300), "meta": {"step": 0}}
    dcp.load(out, storage_reader=Reader(url))
    assert torch.equal(out["big"], big) and out["meta"] == {"step": 4}
    assert _ranged_read(url, read_bytes, (1000, 0), (4, 300)) == _bits(big[1000:1004])
