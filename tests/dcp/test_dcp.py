"""ckptio.dcp in one process: every dtype bit-exact, sub-rectangle reads, metadata, errors, staging.

Multi-process (gloo) DTensor resharding, deterministic resume and async_save
with both executors are in tests/dcp/test_dcp_multiprocess.py.
"""

from __future__ import annotations

import gc
import os
import pickle
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import ckptio
from ckptio.backends.memory import MemoryBackend
from ckptio.dcp import HostBuffers, Reader, Stager, Writer, stage_state_dict
from ckptio.engine.layout import HashedNaming
from ckptio.errors import CheckpointNotFoundError
from ckptio.manifest import MANIFEST_NAME

pytestmark = pytest.mark.filterwarnings("ignore")  # DCP warns that no process group is initialized


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


TORCH_DTYPES = [
    "bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "complex64", "complex128",
]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def _state() -> dict:
    sd: dict = {}
    for i, name in enumerate(TORCH_DTYPES):
        if hasattr(torch, name):
            dt = getattr(torch, name)
            sd[name] = {"m": _random((5, 3), dt, i), "s": _random((), dt, 100 + i), "e": torch.empty(0, 4, dtype=dt)}
    sd["values"] = {"step": 12, "name": "run/1", "lr": 0.125, "list": [1, 2, 3]}
    return sd


def _zeros_like(sd):
    if isinstance(sd, dict):
        return {k: _zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return None if not isinstance(sd, (int, float, str, list)) else type(sd)()


@pytest.mark.parametrize("where", ["local", "mem"])
def test_every_dtype_round_trips_bit_exact(tmp_path, where):
    url = str(tmp_path / "ck") if where == "local" else f"mem://dcp-dtypes-{os.getpid()}"
    sd = _state()
    md = dcp.save(sd, storage_writer=Writer(url))
    assert md.storage_data  # like FileSystemWriter: the returned Metadata says where each item went
    out = _zeros_like(sd)
    dcp.load(out, storage_reader=Reader(url))
    for name in TORCH_DTYPES:
        if name in sd:
            for k in ("m", "s", "e"):
                got, want = out[name][k], sd[name][k]
                assert got.dtype == want.dtype and got.shape == want.shape and _bits(got) == _bits(want), (name, k)
    assert out["values"] == sd["values"]
    if where == "mem":
        MemoryBackend.forget(url)


def test_dcp_checkpoint_is_a_native_one_and_back(tmp_path):
    url = str(tmp_path / "ck")
    sd = {"model": {"w": _random((4, 6), torch.bfloat16, 1), "b": torch.arange(6.0)}, "step": 3}
    dcp.save(sd, storage_writer=Writer(url))
    native = ckptio.restore(url)  # {fqn: array}; byte items are the planner's raw bytes
    assert native["model.w"].dtype.name == "bfloat16" and native["model.w"].tobytes() == _bits(sd["model"]["w"])
    assert np.array_equal(native["model.b"], np.arange(6.0))
    assert native["step"].dtype == np.uint8
    # planner_data survives as JSON: DCP can rebuild the nested dict without a template.
    everything = _load_state_dict_from_keys(storage_reader=Reader(url))
    assert everything["step"] == 3 and torch.equal(everything["model"]["b"], torch.arange(6.0))
    # And a checkpoint saved by the native API loads through DCP (its arrays, as tensors).
    # (Leaves without a torch dtype -- strings, Python values -- are not offered.)
    native_state = {"a": np.arange(12, dtype=np.int32).reshape(3, 4), "names": np.array(["x", "y"]), "n": 1}
    ckptio.save(tmp_path / "native", native_state, step=2).result()
    assert set(Reader(tmp_path / "native", step=2).read_metadata().state_dict_metadata) == {"a"}
    tgt = {"a": torch.zeros(3, 4, dtype=torch.int32)}
    dcp.load(tgt, storage_reader=Reader(tmp_path / "native", step=2))
    assert torch.equal(tgt["a"], torch.arange(12, dtype=torch.int32).reshape(3, 4))


class _Planner:
    """The part of a LoadPlanner that read_data uses, handing out given targets."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []

    def resolve_tensor(self, ri: ReadItem) -> torch.Tensor:
        return self.targets[ri.dest_index.fqn]

    def commit_tensor(self, ri: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(ri.dest_index.fqn)


def _read(fqn: str, offsets: tuple[int, ...], lengths: tuple[int, ...], dest: str,
          chunk: tuple[int, ...] | None = None) -> ReadItem:
    """Read ``lengths`` at ``offsets`` of the saved chunk at ``chunk`` (default: the origin) into ``dest``."""
    return ReadItem(LoadItemType.TENSOR, MetadataIndex(dest), torch.Size([0] * len(offsets)),
                    MetadataIndex(fqn, chunk or (0,) * len(offsets)), torch.Size(offsets), torch.Size(lengths))


def test_sub_rectangles_are_ranged_reads_across_objects(tmp_path):
    # 1.6 MiB in 1 MiB objects: the chunk is split mid-row; 4 KiB checksum blocks.
    url = str(tmp_path / "ck")
    full = torch.randn(600, 700, generator=torch.Generator().manual_seed(7))
    dcp.save({"w": full}, storage_writer=Writer(url, engine_config=ckptio.EngineConfig(block_size=4096),
                                                backend_options={"object_size": 1 << 20}))
    assert len([n for n in os.listdir(url) if n != MANIFEST_NAME]) == 2
    reader = Reader(url)
    reader.read_metadata()
    cases = {
        "rows": ((300, 0), (150, 700)),  # whole rows across the object boundary: straight into the target
        "box": ((370, 100), (10, 250)),  # a sub-rectangle: rows through scratch, then scattered
        "corner": ((599, 699), (1, 1)),
    }
    targets = {k: torch.empty(n) for k, (_o, n) in cases.items()}
    targets["strided"] = torch.empty(250, 10).t()  # not contiguous: through a host tensor
    targets["cast"] = torch.empty(10, 250, dtype=torch.float64)  # DCP's reader casts on copy_
    items = [_read("w", o, n, k) for k, (o, n) in cases.items()]
    items += [_read("w", (370, 100), (10, 250), "strided"), _read("w", (370, 100), (10, 250), "cast")]
    planner = _Planner(targets)
    reader.read_data(LoadPlan(items), planner).wait()
    for k, ((r, c), (h, w)) in cases.items():
        assert _bits(targets[k]) == _bits(full[r : r + h, c : c + w]), k
    assert torch.equal(targets["strided"], full[370:380, 100:350])
    assert torch.equal(targets["cast"], full[370:380, 100:350].double())
    assert sorted(planner.committed) == sorted([*cases, "strided", "cast"])


def test_step_layout_and_hashed_names():
    url = f"mem://dcp-hashed-{os.getpid()}"
    sd = {"w": torch.arange(10.0), "step": 5}
    dcp.save(sd, storage_writer=Writer(url, step=5, naming=HashedNaming()))
    store = ckptio.CheckpointManager(url).store
    from ckptio.engine import run_sync

    assert run_sync(store.committed_steps()) == [5]
    manifest = run_sync(store.read_manifest("5"))
    # The hashed component comes first, before the step: every save spreads over the same key ranges.
    assert manifest.objects and all(k.split("/")[0].startswith("h") and k.split("/")[1] == "5" for k in manifest.objects)
    out = {"w": torch.zeros(10), "step": 0}
    dcp.load(out, storage_reader=Reader(url, step=5))
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 5
    assert ckptio.restore(url)["w"].tolist() == list(range(10))  # newest step, natively
    MemoryBackend.forget(url)


def _expect_failure(fn, *needles: str) -> str:
    """Run a DCP call that must fail; DCP wraps errors in CheckpointException (a BaseException)."""
    with pytest.raises(CheckpointException) as info:
        fn()
    text = str(info.value)
    for n in needles:
        assert n in text, (n, text[-2000:])
    return text


def test_missing_uncommitted_and_existing_checkpoints_are_named(tmp_path):
    missing = str(tmp_path / "nothing-here")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*nothing-here"):
        Reader(missing).read_metadata()
    _expect_failure(lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=Reader(missing)), missing)

    url = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(3)}, storage_writer=Writer(url))
    _expect_failure(lambda: dcp.save({"w": torch.ones(3)}, storage_writer=Writer(url, overwrite=False)),
                    "Checkpoint already exists", url)
    os.remove(os.path.join(url, MANIFEST_NAME))  # as if the coordinator died before the commit
    _expect_failure(lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=Reader(url)), "not committed", url)

    root = str(tmp_path / "run")
    dcp.save({"w": torch.ones(3)}, storage_writer=Writer(root, step=7))
    os.remove(os.path.join(root, "7", MANIFEST_NAME))
    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        Reader(root, step=7).read_metadata()


def test_reader_of_a_root_of_steps_reads_its_newest_committed_step(tmp_path):
    """#36: ``Reader(root)`` without a step takes the newest committed step, as ``ckptio.restore`` does,
    decided afresh at each load; an uncommitted newer step is passed over."""
    root = str(tmp_path / "run")
    for step in (1, 2):
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=Writer(root, step=step))
    reader = Reader(root)
    sd = {"w": torch.zeros(3)}
    dcp.load(sd, storage_reader=reader)
    assert sd["w"].tolist() == [2.0] * 3 and reader.checkpoint_id.endswith("/2")
    dcp.save({"w": torch.full((3,), 3.0)}, storage_writer=Writer(root, step=3))
    dcp.save({"w": torch.full((3,), 4.0)}, storage_writer=Writer(root, step=4))
    os.remove(os.path.join(root, "4", MANIFEST_NAME))  # step 4's save never committed
    dcp.load(sd, storage_reader=reader)  # the same reader: step 3 is the newest now
    assert sd["w"].tolist() == [3.0] * 3
    sd2 = {"w": torch.zeros(3)}
    dcp.load(sd2, storage_reader=Reader("unused"), checkpoint_id=root)
    assert sd2["w"].tolist() == [3.0] * 3


def test_ranks_that_chose_different_newest_steps_fail_the_load_by_name(tmp_path):
    reader = Reader(tmp_path / "run")
    plans = [LoadPlan([], storage_data={"ckptio.reads": f"{tmp_path}/run/{s}"}) for s in (5, 6)]
    with pytest.raises(CheckpointNotFoundError, match=r"different newest steps.*run/5.*run/6.*step=N"):
        reader.prepare_global_plan(plans)
    assert reader.prepare_global_plan(plans[:1]) == plans[:1]


def test_corrupt_object_is_named(tmp_path):
    url = str(tmp_path / "ck")
    dcp.save({"w": torch.arange(1000.0), "b": torch.ones(4)}, storage_writer=Writer(url))
    (obj,) = [n for n in os.listdir(url) if n not in (MANIFEST_NAME, ".metadata")]  # .metadata: for stock torch
    store = ckptio.store.CheckpointStore(url)
    at = ckptio.engine.run_sync(store.read_manifest("")).items["w"].shards[0].extents[0].offset + 100  # in w's bytes
    ckptio.engine.run_sync(store.close())
    with open(os.path.join(url, obj), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    _expect_failure(lambda: dcp.load({"w": torch.zeros(1000), "b": torch.zeros(4)}, storage_reader=Reader(url)),
                    "IntegrityError", "checksum mismatch", url, obj, "'w'")
    os.remove(os.path.join(url, obj))
    _expect_failure(lambda: dcp.load({"w": torch.zeros(1000), "b": torch.zeros(4)}, storage_reader=Reader(url)),
                    "FileNotFoundError", url, obj)


def test_writer_pickles_small_and_reopens_lazily(tmp_path):
    w = Writer(tmp_path / "ck", buffers=HostBuffers(), engine_config=ckptio.EngineConfig(concurrency=4))
    dcp.save({"w": torch.ones(3)}, storage_writer=w)
    blob = pickle.dumps(w)  # what the process executor sends with every save
    assert len(blob) < 2048, len(blob)
    w2 = pickle.loads(blob)
    assert w2.buffers is None and w2._store is None and w2.engine_config.concurrency == 4
    dcp.save({"w": torch.ones(3)}, storage_writer=w2, checkpoint_id=str(tmp_path / "ck2"))
    r = pickle.loads(pickle.dumps(Reader(tmp_path / "ck2")))
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=r)
    assert torch.equal(out["w"], torch.ones(3))


def test_staging_copies_into_reused_buffers():
    pool = HostBuffers()
    sd = {"a": torch.arange(100.0), "b": [torch.ones(3, dtype=torch.bfloat16), 5], "p": torch.nn.Parameter(torch.ones(2))}
    sd["alias"] = sd["a"]
    staged = stage_state_dict(sd, pool)
    sd["a"].zero_()
    assert staged["a"].tolist() == list(map(float, range(100))) and staged["alias"] is staged["a"]
    assert staged["b"][1] == 5 and not staged["p"].requires_grad
    assert pool.allocated == 3 and pool.reused == 0
    again = stage_state_dict(sd, pool)  # the first staged copy is still alive: fresh buffers
    assert pool.allocated == 6 and pool.reused == 0
    del staged, again
    gc.collect()
    stage_state_dict(sd, pool)
    assert pool.allocated == 6 and pool.reused == 3


def test_async_save_in_one_process_stages_and_reuses(tmp_path):
    pool = HostBuffers()
    sd = {"w": torch.ones(4), "step": 1}
    f = dcp.async_save(sd, storage_writer=Writer(tmp_path / "a", buffers=pool))
    sd["w"].zero_()  # after staging: not in the checkpoint
    f.result()
    # The stager also serves other writers (here DCP's own).
    dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "b")), async_stager=Stager(pool)).result()
    out = {"w": torch.zeros(4), "step": 0}
    dcp.load(out, storage_reader=Reader(tmp_path / "a"))
    assert out["w"].tolist() == [1.0] * 4 and out["step"] == 1
    for _ in range(200):  # the executor drops the staged dict just after the save ends
        gc.collect()
        if pool.free_bytes():
            break
        time.sleep(0.02)
    allocated, reused = pool.allocated, pool.reused
    Stager(pool).stage(sd)
    assert pool.reused > reused and pool.allocated == allocated


@pytest.mark.gcs
def test_gs_url_through_fake_gcs(gcs_emulator_env):
    root = f"gs://ckptio-test/dcp-{os.getpid()}"
    sd = {"w": _random((64, 33), torch.bfloat16, 3), "step": 9}
    dcp.save(sd, storage_writer=Writer(root, step=9))
    from ckptio.engine import run_sync
    from ckptio.store import CheckpointStore

    manifest = run_sync(CheckpointStore(root).read_manifest("9"))
    assert all(k.split("/")[0].startswith("h") for k in manifest.objects)  # hashed names on object stores
    out = {"w": torch.zeros(64, 33, dtype=torch.bfloat16), "step": 0}
    dcp.load(out, storage_reader=Reader(root, step=9))
    assert _bits(out["w"]) == _bits(sd["w"]) and out["step"] == 9
    _expect_failure(lambda: dcp.load(out, storage_reader=Reader(root, step=10)), f"{root}/10")


def test_an_async_save_gives_its_staged_buffers_back_without_the_cyclic_gc(tmp_path):
    """The staged copy dies with the save, by reference counting: the next save reuses every buffer. Staging's
    recursive walk held all staged tensors in a cycle until the collector ran, so the next save of a 1 GiB
    state faulted in a second GiB (a 1.2 s stall here) and the process held both."""
    pool = HostBuffers()
    sd = {f"w{i}": _random((256, 1024), torch.float32, i) for i in range(6)}
    gc.collect()
    gc.disable()
    try:
        dcp.async_save(sd, storage_writer=Writer(tmp_path / "a", buffers=pool)).result()
        for _ in range(500):  # the executor's thread drops the staged dict just after the save ends
            if pool.free_count() == len(sd):
                break
            time.sleep(0.01)
        assert pool.free_count() == len(sd) == pool.allocated
        dcp.async_save(sd, storage_writer=Writer(tmp_path / "b", buffers=pool)).result()
        assert pool.allocated == len(sd) and pool.reused == len(sd)
    finally:
        gc.enable()


def test_an_async_save_checksums_while_staging_and_its_write_reuses_the_sums(tmp_path, monkeypatch):
    """stage() checksums each copy on a helper thread while the next is copied; the write, beside the training
    step, reuses them instead of checksumming 1 MiB blocks itself (each call a GIL hand-over: with the step
    pinned, 97-119 ms of its time per 1 GiB save against 36-52 ms, issue 35). The sums are the staged bytes'
    own: a restore verifies against them, and a flipped byte is caught."""
    import ckptio.engine.core as engine
    from ckptio.dcp._stagedsums import StagedSums
    from ckptio.engine.layout import extent_block

    summed: list[int] = []
    real = engine.block_crcs

    def spy(view, block):
        summed.append(memoryview(view).nbytes)
        return real(view, block)

    monkeypatch.setattr(engine, "block_crcs", spy)
    sd = {f"w{i}": _random((512, 1024), torch.float32, i) for i in range(4)}  # 2 MiB each
    sd["small"] = _random((3, 5), torch.float32, 9)
    dcp.async_save(sd, storage_writer=Writer(tmp_path / "a")).result()
    assert all(n < (2 << 20) for n in summed), "no staged tensor checksummed again by the engine"
    dcp.save(sd, storage_writer=Writer(tmp_path / "sync"))  # nothing staged: the engine checksums
    assert sum(n == (2 << 20) for n in summed) == 4
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=Reader(tmp_path / "a"))
    assert all(_bits(out[k]) == _bits(sd[k]) for k in sd)
    store = ckptio.store.CheckpointStore(str(tmp_path / "a"))
    manifest = ckptio.engine.run_sync(store.read_manifest(""))
    ckptio.engine.run_sync(store.close())
    ext = manifest.items["w2"].shards[0].extents[0]
    key = manifest.objects[ext.object]
    with open(tmp_path / "a" / key, "r+b") as f:  # a byte inside w2's data
        f.seek(ext.offset + 1000)
        byte = f.read(1)
        f.seek(ext.offset + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    _expect_failure(lambda: dcp.load({k: torch.zeros_like(v) for k, v in sd.items()},
                                     storage_reader=Reader(tmp_path / "a")), "checksum mismatch", key, "'w2'")
    # The sums answer only for a staged tensor's exact bytes, in the blocks its extents have.
    sums = StagedSums(1 << 20)
    staged = stage_state_dict({"w": sd["w0"]}, HostBuffers(), sums.add)
    sums.wait()
    whole = memoryview(staged["w"].numpy()).cast("B")
    block = extent_block(whole.nbytes, True, 1 << 20)
    assert 0 < block < (1 << 20) and sums.take(whole, block) == real(whole, block)
    assert sums.take(whole[4096:], block) is None and sums.take(whole, 1 << 20) is None
    assert sums.take(memoryview(sd["w0"].numpy()).cast("B"), block) is None  # the original, not the copy


def test_async_save_writes_staged_buffers_without_a_bounce_copy(tmp_path, monkeypatch):
    """Staged buffers are page-aligned, so the local backend's O_DIRECT writes take them as they are:
    no bytes of an async save are copied again through its bounce buffer (torch.empty's memory,
    64 bytes into a page, was copied whole on every save)."""
    from ckptio.backends._bounce import BOUNCE

    lent = BOUNCE.lent
    pool = HostBuffers()
    sd = {f"w{i}": _random((512, 1024), torch.float32, i) for i in range(4)}  # 2 MiB each
    staged = stage_state_dict(sd, pool)
    assert all(t.data_ptr() % 4096 == 0 for t in staged.values())
    del staged
    dcp.async_save(sd, storage_writer=Writer(tmp_path / "a", buffers=pool)).result()
    assert BOUNCE.lent == lent
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=Reader(tmp_path / "a"))
    assert all(_bits(out[k]) == _bits(sd[k]) for k in sd)


def test_sync_save_writes_torch_memory_to_the_device_as_it_lies(tmp_path, monkeypatch):
    """``dcp.save`` hands over the caller's tensors, not page-aligned (torch aligns to 64 bytes). Each lies in its
    object at an offset in step with its memory, so O_DIRECT takes its pages as they are: the bounce buffer
    copies only the partial pages at either end and the frames. Before, every byte was either copied through
    the bounce buffer or through the page cache (the kernel's copy, and a sync save's CPU at or above stock
    DCP's; issue 35)."""
    from tests.backends.test_local import direct_root

    import ckptio.backends._direct as direct

    root = direct_root(tmp_path)
    sd = {f"w{i}": _random((512, 1024), torch.float32, i) for i in range(4)}  # 2 MiB each: direct-sized
    for i in range(2):  # numpy's memory through torch.from_numpy: 16 bytes past a 64-byte boundary
        raw = np.empty((2 << 20) + 64, np.uint8)
        at = -raw.ctypes.data % 64 + 16
        raw[at : at + (2 << 20)] = np.random.default_rng(i).integers(0, 256, 2 << 20, np.uint8)
        sd[f"np{i}"] = torch.from_numpy(raw[at : at + (2 << 20)].view(np.float32))
    assert any(t.data_ptr() % 4096 for t in sd.values())
    direct_opens, fsyncs, copied = [], [], []
    real_open, real_fsync, real_copy = os.open, os.fsync, direct.copy_bytes

    def spy_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            direct_opens.append(path)
        return real_open(path, flags, *args, **kwargs)

    def spy_fsync(fd):
        fsyncs.append(fd)
        real_fsync(fd)

    def spy_copy(dst, src):
        copied.append(src.nbytes)
        real_copy(dst, src)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(direct, "copy_bytes", spy_copy)
    for name, options in {"sync": None, "direct": {"direct_unaligned": True}}.items():
        direct_opens.clear(), fsyncs.clear(), copied.clear()
        dcp.save(sd, storage_writer=Writer(root / name, backend_options=options))
        objects = [p for p in (root / name).iterdir() if not p.name.startswith(("ckptio.", "."))]
        assert objects and direct_opens
        assert 0 < sum(copied) <= len(sd) * 3 * 4096, "partial pages and frames only, not 8 MiB of tensors"
        assert len(fsyncs) >= len(objects) + 1, "every object, and the manifest, fsync'd before the commit"
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=Reader(root / name))
        assert all(_bits(out[k]) == _bits(sd[k]) for k in sd)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(root / name)))  # stock torch reads it too
        assert all(_bits(out[k]) == _bits(sd[k]) for k in sd)
