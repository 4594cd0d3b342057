"""Tiled shards: any sharding restores bit-exact, a column block reads about what it needs,
and a flipped byte in a partly read tile is still caught."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

import ckptio
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import CountingBackend
from ckptio.engine import run_sync
from ckptio.engine.tiling import tile_boxes, tile_for, tiles_meeting
from ckptio.errors import IntegrityError
from ckptio.manifest import MANIFEST_NAME, unseal
from ckptio.store import CheckpointStore

# -- the arithmetic ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(7, 9), (37, 53), (4, 5, 6), (1, 100), (100, 1), (3, 1, 8, 2)])
@pytest.mark.parametrize("tile_elems", [1, 6, 20, 64])
def test_tiles_partition_the_shard_and_are_found_where_the_stream_puts_them(shape, tile_elems):
    tile = tile_for(shape, 1, tile_elems // 2) or tuple(max(1, n // 2) for n in shape)
    boxes = list(tile_boxes(shape, tile))
    assert sum(math.prod(s) for _o, s, _p in boxes) == math.prod(shape)
    assert [p for _o, _s, p in boxes] == list(itertools.accumulate([0] + [math.prod(s) for _o, s, _p in boxes[:-1]]))
    covered = np.zeros(shape, np.int32)
    for o, s, _p in boxes:
        covered[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
    assert (covered == 1).all()
    where = {o: p for o, _s, p in boxes}
    rng = np.random.default_rng(0)
    for _ in range(20):
        off = tuple(int(rng.integers(0, n)) for n in shape)
        size = tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(off, shape))
        met = tiles_meeting(shape, tile, off, size)
        assert all(where[o] == p for o, _s, p in met)
        box = np.zeros(shape, bool)
        box[tuple(slice(a, a + n) for a, n in zip(off, size))] = True
        touched = {o for o, s, _p in boxes if box[tuple(slice(a, a + n) for a, n in zip(o, s))].any()}
        assert {o for o, _s, _p in met} == touched


def test_tile_choice():
    assert tile_for((1024, 16384), 4, 1 << 20) == (512, 512)  # near square, 1 MiB
    assert tile_for((1 << 20,), 4, 1 << 20) is None  # 1-D: C order reads any range alone
    assert tile_for((100, 100), 4, 1 << 20) is None  # small: nothing to gain
    assert tile_for((1 << 16, 64), 4, 1 << 20) is None  # tiles would be whole rows: that is C order
    assert tile_for((1024, 16384), 4, 0) is None  # tile_bytes=0 turns tiling off


# -- restores --------------------------------------------------------------------------------

SMALL_TILES = {"engine_config": ckptio.EngineConfig(block_size=512), "save_options": ckptio.SaveOptions(tile_bytes=512)}


def _splits(n: int, k: int) -> list[slice]:
    """``k`` uneven, non-dividing slices covering ``[0, n)``."""
    cuts = sorted({0, n, *np.random.default_rng(n * 31 + k).choice(np.arange(1, n), k - 1, replace=False).tolist()})
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def _grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[tuple[slice, ...]]:
    return list(itertools.product(*(_splits(n, k) if k > 1 else [slice(0, n)] for n, k in zip(shape, parts))))


@pytest.mark.parametrize(
    ("shape", "saved", "restored"),
    [
        ((8192,), (5,), (3,)),
        ((97, 131), (4, 1), (1, 5)),  # rows -> columns
        ((97, 131), (1, 3), (6, 1)),  # columns -> rows
        ((97, 131), (3, 2), (2, 3)),
        ((23, 19, 29), (2, 1, 3), (1, 4, 2)),
        ((23, 19, 29), (3, 1, 1), (1, 1, 1)),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.complex128])
def test_any_resharding_of_tiled_shards_is_bit_exact(tmp_path, shape, saved, restored, dtype):
    full = (np.arange(math.prod(shape)) * 7 + 3).astype(dtype).reshape(shape)
    pieces = [(ix, full[ix]) for ix in _grid(shape, saved)]
    ckptio.save(tmp_path, {"a": ckptio.Sharded(shape, full.dtype, pieces)}, step=1, **SMALL_TILES).result()
    want = _grid(shape, restored)
    out = ckptio.restore(tmp_path, target={"a": ckptio.Sharded(shape, full.dtype, [(ix, None) for ix in want])})
    for ix, got in out["a"].pieces:
        assert got.dtype == full.dtype and got.tobytes() == full[ix].tobytes(), ix
    whole = ckptio.restore(tmp_path)["a"]
    assert whole.tobytes() == full.tobytes()
    doc = json.loads(unseal((tmp_path / "1" / MANIFEST_NAME).read_bytes(), "m"))
    tiled = any("tile" in s for s in doc["items"]["a"]["shards"])
    assert tiled == (len(shape) > 1)
    assert doc["version"] == (3 if tiled else 1)  # a reader without tiles must refuse, not misread


def test_jax_and_torch_leaves_are_tiled_too(tmp_path):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    state = {"t": torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96),
             "j": jnp.arange(64 * 96, dtype=jnp.int32).reshape(64, 96)}
    ckptio.save(tmp_path, state, step=1, **SMALL_TILES).result()
    out = ckptio.restore(tmp_path, target={
        "t": ckptio.Sharded((64, 96), np.float32, [((slice(None), slice(40, 77)), None)]),
        "j": ckptio.Sharded((64, 96), np.int32, [((slice(3, 50), slice(5, 9)), None)])})
    assert (out["t"].pieces[0][1] == state["t"].numpy()[:, 40:77]).all()
    assert (out["j"].pieces[0][1] == np.asarray(state["j"])[3:50, 5:9]).all()


def test_a_column_block_of_row_saved_shards_reads_about_what_it_needs(tmp_path):
    """16 MiB saved as 16 row blocks with the default layout; a 1/16 column block reads <= 1.5x."""
    url = f"mem://cols-{tmp_path.name}"
    n = 2048
    full = np.arange(n * n, dtype=np.float32).reshape(n, n)
    rows = [(slice(i * n // 16, (i + 1) * n // 16), slice(None)) for i in range(16)]
    big = {"engine_config": ckptio.EngineConfig(block_size=64 << 10),  # 16 MiB scaled like 1 GiB at 1 MiB
           "save_options": ckptio.SaveOptions(tile_bytes=64 << 10)}
    ckptio.save(url, {"w": ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix]) for ix in rows])}, step=1,
                **big).result()
    for col in (slice(5 * n // 16, 6 * n // 16), slice(n // 4, n // 2)):
        counting = CountingBackend(MemoryBackend(url))
        index = (slice(None), col)
        out = ckptio.restore(url, backend=counting, target={"w": ckptio.Sharded(full.shape, full.dtype, [(index, None)])})
        got = out["w"].pieces[0][1]
        assert got.tobytes() == full[index].tobytes()
        read = sum(r.length for k, r in counting.reads if "ckptio." not in k)
        assert got.nbytes <= read <= 1.5 * got.nbytes, (col, read / got.nbytes)


def _corrupt_inside_tile(root, index: tuple[slice, slice]) -> None:
    """Flip one byte of the stored tile that holds element ``index``'s first element (rows saved)."""
    store = CheckpointStore(str(root))
    try:
        m = run_sync(store.read_manifest("1"))
    finally:
        run_sync(store.close())
    item = m.items["w"]
    at = tuple(s.start for s in index)
    shard = next(s for s in item.shards if all(o <= a < o + n for a, o, n in zip(at, s.offsets, s.shape)))
    rel = tuple(a - o for a, o in zip(at, shard.offsets))
    ((_t_off, _t_shape, pos),) = tiles_meeting(shard.shape, shard.tile, rel, (1, 1))
    pos *= item.dtype.itemsize
    e = next(e for e in shard.extents if e.shard_offset <= pos < e.shard_offset + e.length)
    path = root / m.objects[e.object]
    data = bytearray(path.read_bytes())
    data[e.offset + (pos - e.shard_offset) + 3] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_partly_read_tile_is_caught_and_other_tiles_still_restore(tmp_path):
    n = 256
    full = np.arange(n * n, dtype=np.float32).reshape(n, n)
    rows = [(slice(i * 64, (i + 1) * 64), slice(None)) for i in range(4)]
    ckptio.save(tmp_path, {"w": ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix]) for ix in rows])}, step=1,
                engine_config=ckptio.EngineConfig(block_size=4096), save_options=ckptio.SaveOptions(tile_bytes=4096)
                ).result()
    bad = (slice(70, 71), slice(100, 101))  # one element: the request reads part of one tile
    _corrupt_inside_tile(tmp_path, bad)
    with pytest.raises(IntegrityError):
        ckptio.restore(tmp_path, target={"w": ckptio.Sharded(full.shape, full.dtype, [(bad, None)])})
    with pytest.raises(IntegrityError):
        ckptio.restore(tmp_path)
    ok = (slice(0, 64), slice(0, 32))  # other tiles: still readable and verified
    out = ckptio.restore(tmp_path, target={"w": ckptio.Sharded(full.shape, full.dtype, [(ok, None)])})
    assert out["w"].pieces[0][1].tobytes() == full[ok].tobytes()


def test_scratch_is_taken_when_a_read_starts_and_reused_after_its_copy_out(tmp_path, monkeypatch):
    """A column block of 16 tiles, two reads at a time: fresh scratch for the reads in flight only,
    not one buffer per tile made at planning (each a page fault per page)."""
    from ckptio.engine.scratch import ScratchPool

    url = f"mem://scratch-{tmp_path.name}"
    n = 2048
    full = np.arange(n * n, dtype=np.float32).reshape(n, n)
    rows = [(slice(i * n // 16, (i + 1) * n // 16), slice(None)) for i in range(16)]
    small = {"engine_config": ckptio.EngineConfig(block_size=64 << 10), "save_options": ckptio.SaveOptions(tile_bytes=64 << 10)}
    ckptio.save(url, {"w": ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix]) for ix in rows])}, step=1,
                **small).result()
    takes = {"fresh": 0, "reused": 0}
    real_take = ScratchPool.take

    def counting_take(self: ScratchPool, nbytes: int) -> np.ndarray:
        takes["reused" if self.has(nbytes) else "fresh"] += 1
        return real_take(self, nbytes)

    monkeypatch.setattr(ScratchPool, "take", counting_take)
    index = (slice(None), slice(5 * n // 16, 6 * n // 16))  # one tile of each row block
    out = ckptio.restore(url, target={"w": ckptio.Sharded(full.shape, full.dtype, [(index, None)])},
                         engine_config=ckptio.EngineConfig(concurrency=2))
    assert out["w"].pieces[0][1].tobytes() == full[index].tobytes()
    assert takes["fresh"] + takes["reused"] == 16
    assert takes["fresh"] <= 4, takes


def test_scratch_memory_exists_only_between_its_read_and_its_release():
    from ckptio.engine.scratch import Scratch, ScratchPool

    pool = ScratchPool()
    s = Scratch(8)
    with pytest.raises(RuntimeError, match="before any read"):
        s.array()
    a, b = pool.resolve([s.slice(0, 4), s.slice(4, 8)])  # two requests' views of one scratch
    a[:] = b"abcd"
    b[:] = b"efgh"
    assert s.array().tobytes() == b"abcdefgh"
    mem = s.array()
    s.release()
    s.release()  # a second release gives nothing back twice
    with pytest.raises(RuntimeError, match="after its release"):
        s.array()
    assert pool.take(8) is mem and pool.take(8) is not mem
    small = ScratchPool(keep_bytes=8)
    kept, dropped = small.take(8), small.take(8)
    small.give_back([kept])
    small.give_back([dropped])  # over keep_bytes: freed, not kept
    assert small.take(8) is kept and small.take(8) is not dropped
