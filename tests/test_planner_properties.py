"""The vectorised planner (ckptio.reshard over ShardTable) against the old per-shard planner.

Random saved shardings x target shardings x dtypes x uneven shapes x tiled/untiled shards x
extents split over objects x small checksum blocks: the new plan reads exactly the byte ranges
the old one read (as a union; never more bytes in total), every byte it reads is covered by a
checksum check, and executing it restores the target regions bit-exact. A corrupted object is
caught before its bytes reach a destination.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from _old_planner import plan_region as old_plan_region
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.checksum import block_crcs, verify_blocks
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import ArrayItem, Extent, FragmentRef, Manifest, ShardRecord
from ckptio.manifest.codec.columns import decode_columns, encode_columns, from_columns
from ckptio import reshard
from ckptio.readpieces import ConcatView
from ckptio.reshard import Region, coverage_gaps, plan_region, plan_regions, shard_grid
from ckptio.scratch import ScratchPool
from ckptio.tiling import tile_boxes

DTYPES = [np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.float32), np.dtype(np.float64),
          np.dtype(ml_dtypes.bfloat16)]
PROFILE = settings(max_examples=60, derandomize=True, deadline=None)


def _cuts(draw: st.DrawFn, n: int, most: int) -> list[int]:
    inner = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=min(most, max(n - 1, 0))))
    return [0, *sorted(c for c in inner if 0 < c < n), n]


def _grid(cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every cell of the grid the per-dimension cuts make, as ``(offsets, shape)``."""
    spans = [list(zip(c, c[1:])) for c in cuts]
    return [(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*spans)]


def _stream(block: np.ndarray, tile: tuple[int, ...] | None) -> bytes:
    """A shard's bytes as saved: C order, or its tiles in stream order (each C order)."""
    if tile is None:
        return block.tobytes()
    out = b""
    for offs, sizes, _pos in tile_boxes(block.shape, tile):
        out += np.ascontiguousarray(block[tuple(slice(o, o + n) for o, n in zip(offs, sizes))]).tobytes()
    return out


@st.composite
def saved(draw: st.DrawFn) -> tuple[ArrayItem, np.ndarray, dict[str, bytes], int]:
    """An array saved as a random grid of shards, some tiled, each split into extents packed in
    a few objects at random offsets, with small checksum blocks."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    full = np.arange(math.prod(shape), dtype=np.int64).astype(dtype).reshape(shape) if ndim else \
        np.array(draw(st.integers(0, 200)), dtype)
    bs = draw(st.sampled_from([4, 8, 24, 64, 4096]))
    n_obj = draw(st.integers(1, 3))
    objects = [bytearray(draw(st.binary(max_size=7))) for _ in range(n_obj)]
    shards = []
    for off, sh in _grid([_cuts(draw, n, 3) for n in shape]):
        tiled = ndim >= 2 and draw(st.booleans())
        tile = tuple(draw(st.integers(1, n)) for n in sh) if tiled else None
        data = _stream(full[tuple(slice(o, o + n) for o, n in zip(off, sh))], tile)
        cuts = sorted({0, len(data), *draw(st.sets(st.integers(1, max(len(data) - 1, 1)), max_size=2))})
        extents = []
        for a, b in zip(cuts, cuts[1:]):
            if a >= b:
                continue
            o = draw(st.integers(0, n_obj - 1))
            objects[o] += draw(st.binary(max_size=5))  # a gap: bytes of no shard
            extents.append(Extent(o, len(objects[o]), a, b - a, block_crcs(memoryview(data[a:b]), bs), bs))
            objects[o] += data[a:b]
        shards.append(ShardRecord(off, sh, 0, extents, tile))
    item = ArrayItem(dtype, shape, shards)
    return item, full, {f"obj{i}": bytes(o) for i, o in enumerate(objects)}, bs


@st.composite
def target(draw: st.DrawFn, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A target sharding's regions: a grid, or a few arbitrary boxes."""
    if draw(st.booleans()):
        return _grid([_cuts(draw, n, 2) for n in shape])
    boxes = []
    for _ in range(draw(st.integers(1, 3))):
        off = tuple(draw(st.integers(0, n - 1)) for n in shape)
        boxes.append((off, tuple(draw(st.integers(1, n - o)) for o, n in zip(off, shape))))
    return boxes


def _ranges(reqs: list) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for r in reqs:
        out.setdefault(r.key, set()).update(range(r.rng.start, r.rng.end))
    return out


def execute(reqs: list, objects: dict[str, bytes]) -> None:
    """Run read requests against in-memory objects as the engine does: fill, verify every check
    (which must cover every byte read), then the copy-outs."""
    pool = ScratchPool()
    for r in reqs:
        bufs = pool.resolve(r.buffers)
        data = objects[r.key][r.rng.start : r.rng.end]
        assert len(data) == r.rng.length == sum(memoryview(b).nbytes for b in bufs)
        pos = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            mv[:] = data[pos : pos + mv.nbytes]
            pos += mv.nbytes
        covered = set()
        joined = ConcatView(bufs)
        for off, n, crcs, item in r.checks:
            covered.update(range(off, off + n))
            verify_blocks(joined.slice(off, n), crcs, r.block_size, key=r.key, item=item)
        assert covered == set(range(r.rng.length)), "bytes read but not verified"
        for fn in r.after:
            fn()


@PROFILE
@given(st.data())
def test_reads_what_the_old_planner_read_and_restores_bit_exact(data: st.DataObject) -> None:
    item, full, objects, bs = data.draw(saved())
    keys = list(objects)
    for off, shape in data.draw(target(item.shape)):
        new = plan_region("x", item, Region(off, np.zeros(shape, item.dtype)), keys, bs)
        old = old_plan_region("x", item, Region(off, np.zeros(shape, item.dtype)), keys, bs)
        assert _ranges(new) == _ranges(old)
        assert sum(r.rng.length for r in new) <= sum(r.rng.length for r in old)
        assert len(new) <= len(old)
        dest = np.full(shape, 77, item.dtype)
        execute(plan_region("x", item, Region(off, dest), keys, bs), objects)
        want = full[tuple(slice(o, o + n) for o, n in zip(off, shape))]
        assert dest.tobytes() == want.tobytes()
        assert coverage_gaps(item, off, shape) == 0


@PROFILE
@given(st.data())
def test_many_items_planned_together_restore_bit_exact(data: st.DataObject) -> None:
    """Regions of several arrays planned at once (their pieces coalesced across arrays) give
    each array's bytes, reading no byte the per-region plans do not read."""
    a, fa, objects, bs = data.draw(saved())
    # The same saved array under two names: their pieces interleave in the same objects.
    keys = list(objects)
    wants, expect, alone = [], [], []
    for off, shape in data.draw(target(a.shape)):
        for name, item, full in (("a", a, fa), ("a2", a, fa)):
            dest = np.zeros(shape, item.dtype)
            wants.append((name, item, Region(off, dest)))
            expect.append((dest, full[tuple(slice(o, o + n) for o, n in zip(off, shape))]))
            alone += plan_region(name, item, Region(off, np.zeros(shape, item.dtype)), keys, bs)
    reqs = plan_regions(wants, keys, bs)
    assert _ranges(reqs) == _ranges(alone)
    execute(reqs, objects)
    for dest, want in expect:
        assert dest.tobytes() == want.tobytes()
    batch, reshard._BATCH_SEGMENTS = reshard._BATCH_SEGMENTS, 1  # every region planned in a batch of its own
    try:
        for _name, _item, region in wants:
            region.dest[...] = 0
        reqs = plan_regions(wants, keys, bs)
    finally:
        reshard._BATCH_SEGMENTS = batch
    assert _ranges(reqs) == _ranges(alone)
    execute(reqs, objects)
    for dest, want in expect:
        assert dest.tobytes() == want.tobytes()


def test_a_column_block_of_row_shards_reads_each_object_run_once() -> None:
    """Rows -> columns: the pieces of many shards back to back in one object are one read."""
    rows, cols, hosts = 64, 32, 16
    full = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    blob, shards = b"", []
    for h in range(hosts):
        part = full[h * 4 : (h + 1) * 4].tobytes()
        shards.append(ShardRecord((h * 4, 0), (4, cols), h, [Extent(0, len(blob), 0, len(part),
                                                                    block_crcs(memoryview(part), 4096), 4096)]))
        blob += part
    item = ArrayItem(np.dtype(np.float32), (rows, cols), shards)
    dest = np.zeros((rows, 3), np.float32)
    reqs = plan_region("w", item, Region((0, 5), dest), ["o"], 4096)
    assert len(reqs) == 1 and reqs[0].rng.length == len(blob) and len(reqs[0].checks) == hosts
    execute(reqs, {"o": blob})
    assert (dest == full[:, 5:8]).all()
    assert shard_grid(item) == (4, 32)


def test_corrupt_bytes_never_reach_the_destination() -> None:
    full = np.arange(64 * 8, dtype=np.int32).reshape(64, 8)
    blob = full.tobytes()
    item = ArrayItem(np.dtype(np.int32), (64, 8), [
        ShardRecord((0, 0), (64, 8), 0, [Extent(0, 0, 0, len(blob), block_crcs(memoryview(blob), 256), 256)])])
    bad = bytearray(blob)
    bad[1000] ^= 1
    for off, shape in [((0, 2), (64, 3)), ((3, 0), (50, 8))]:
        dest = np.zeros(shape, np.int32)
        with pytest.raises(IntegrityError, match="'w'"):
            execute(plan_region("w", item, Region(off, dest), ["o"], 256), {"o": bytes(bad)})


@PROFILE
@given(st.data())
def test_columnar_fragments_plan_and_restore_as_the_shards_they_were_written_from(data: st.DataObject) -> None:
    """Format 2: shards written into columnar fragments (each fragment listing the objects), with a
    replica in a second fragment that the root assigns to the first, read back as a ShardTable:
    the same shards (replica dropped), the same reads as the format-1 item, bit-exact."""
    item, full, objects, bs = data.draw(saved())
    n_frag = data.draw(st.integers(1, 3))
    owner = [data.draw(st.integers(0, n_frag - 1)) for _ in item.shards]
    keys = list(objects)
    per_frag: list[list[dict]] = [[] for _ in range(n_frag)]
    for s, f in zip(item.shards, owner):
        row = {"offsets": list(s.offsets), "shape": list(s.shape),
               "extents": [[e.object, e.offset, e.shard_offset, e.length, e.crcs] for e in s.extents],
               **({"tile": list(s.tile)} if s.tile is not None else {})}
        per_frag[f].append(row)
        if f + 1 < n_frag and data.draw(st.booleans()):
            per_frag[f + 1].append(row)  # a replica: the root assigns the box to fragment f
    locator = np.array([[f, *s.offsets, *s.shape] for s, f in zip(item.shards, owner)], np.int64).reshape(
        len(item.shards), 1 + 2 * len(item.shape))
    root_item = ArrayItem(item.dtype, item.shape, [])
    root_item.locator = locator
    refs = [FragmentRef(f"frag{f}", 0, 0, f) for f in range(n_frag)]
    root = Manifest(1, "c", 0.0, bs, n_frag, None, {"x": root_item}, [], fragments=refs, complete=False)
    cols = []
    for f, rows in enumerate(per_frag):
        doc = {"objects": keys, **encode_columns([("x", rows)] if rows else [])}
        cols.append((f, f * len(keys), decode_columns(doc, f"frag{f}")))
    got = from_columns(root, cols, "root", complete=True)["x"]
    all_keys = keys * n_frag
    assert sorted((s.offsets, s.shape, s.tile, [(all_keys[e.object], e.offset, e.shard_offset, e.length, e.crcs)
                                                 for e in s.extents]) for s in got.shards) == \
        sorted((s.offsets, s.shape, s.tile, [(keys[e.object], e.offset, e.shard_offset, e.length, e.crcs)
                                             for e in s.extents]) for s in item.shards)
    for off, shape in data.draw(target(item.shape)):
        new = plan_region("x", got, Region(off, np.zeros(shape, item.dtype)), all_keys, bs)
        old = plan_region("x", item, Region(off, np.zeros(shape, item.dtype)), keys, bs)
        assert _ranges(new) == _ranges(old)
        dest = np.zeros(shape, item.dtype)
        execute(plan_region("x", got, Region(off, dest), all_keys, bs), objects)
        assert dest.tobytes() == full[tuple(slice(o, o + n) for o, n in zip(off, shape))].tobytes()


def test_a_columnar_fragment_that_lies_is_refused() -> None:
    """Columns that do not add up, boxes outside the array and extents that do not hold a
    shard's bytes are ManifestErrors naming the fragment or item, never a plan."""
    shard = {"offsets": [0, 0], "shape": [4, 4], "extents": [[0, 0, 0, 64, [1]]]}
    root_item = ArrayItem(np.dtype(np.float32), (4, 4), [])
    root_item.locator = np.array([[0, 0, 0, 4, 4]], np.int64)
    root = Manifest(1, "c", 0.0, 4096, 1, None, {"x": root_item}, [], fragments=[FragmentRef("f", 0, 0, 0)],
                    complete=False)

    def load(row: dict, **doc_changes: object) -> None:
        doc = {"objects": ["o"], **encode_columns([("x", [row])]), **doc_changes}
        from_columns(root, [(0, 0, decode_columns(doc, "frag f"))], "root", complete=True)

    load(shard)  # as written: fine
    with pytest.raises(ManifestError, match="frag f"):
        load(shard, extents=2)
    with pytest.raises(ManifestError, match="item 'x'"):  # a box the root does not assign it: not whole
        load({**shard, "offsets": [1, 0]})
    with pytest.raises(ManifestError, match="exactly its bytes"):
        load({**shard, "extents": [[0, 0, 0, 60, [1]]]})
    with pytest.raises(ManifestError, match="does not list"):
        load({**shard, "extents": [[1, 0, 0, 64, [1]]]})
