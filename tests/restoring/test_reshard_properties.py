"""The planner (ckptio.restoring.reshard over ShardTable) against a brute-force numpy oracle.

Random saved shardings x target shardings x dtypes x uneven shapes x tiled/untiled shards x
extents split over objects x small checksum blocks. The oracle maps every byte of every shard to
its place in the objects (a position per element, in the shard's stream order), materialises the
saved array from the objects through that map, and lists the exact bytes a target box needs: every
checksum block holding a byte of an element in the box. The plan reads exactly those bytes, each
once, every byte it reads is covered by a checksum check, and executing it restores the target
regions bit-exact. A corrupted object is caught before its bytes reach a destination.
"""

from __future__ import annotations

import collections
import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.engine.readpieces import ConcatView
from ckptio.engine.scratch import ScratchPool
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import ArrayItem, Extent, FragmentRef, Manifest, ShardRecord
from ckptio.manifest.codec.columns import Columns, decode_columns, encode_columns, from_columns
from ckptio.manifest.codec.gather import Gather
from ckptio.restoring import reshard
from ckptio.restoring.reshard import Region, coverage_gaps, plan_region, plan_regions, shard_grid
from ckptio.system.checksum import block_crcs, verify_blocks

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


def _positions(shape: tuple[int, ...], tile: tuple[int, ...] | None) -> np.ndarray:
    """Per element of a shard of ``shape``, its place in the shard's stream (in elements): C order,
    or tiled: the tiles in C order over the tile grid, each tile in C order."""
    pos = np.zeros(shape, np.int64)
    if tile is None:
        return np.arange(pos.size, dtype=np.int64).reshape(shape)
    at = 0
    for start in itertools.product(*(range(0, n, t) for n, t in zip(shape, tile))):
        box = tuple(slice(a, a + t) for a, t in zip(start, tile))
        n = pos[box].size
        pos[box] = np.arange(at, at + n, dtype=np.int64).reshape(pos[box].shape)
        at += n
    assert sorted(pos.ravel().tolist()) == list(range(pos.size))  # a permutation: each element once
    return pos


def _stream(block: np.ndarray, tile: tuple[int, ...] | None) -> bytes:
    """A shard's bytes as saved: its elements in stream order (:func:`_positions`)."""
    out = np.empty(block.size, block.dtype)
    out[_positions(block.shape, tile).ravel()] = block.ravel()
    return out.tobytes()


def _byte_places(item: ArrayItem, shard: ShardRecord, keys: list[str]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per byte of ``shard`` (its shape plus an axis of the dtype's bytes): the object it is
    stored in (index into ``keys``), its offset there, and the start and end of the checksum
    block holding it (offsets in that object)."""
    size = item.dtype.itemsize
    stream = _positions(shard.shape, shard.tile)[..., None] * size + np.arange(size, dtype=np.int64)
    obj, at, b0, b1 = (np.full(stream.shape, -1, np.int64) for _ in range(4))
    for e in shard.extents:
        inside = (stream >= e.shard_offset) & (stream < e.shard_offset + e.length)
        rel = stream[inside] - e.shard_offset
        obj[inside], at[inside] = e.object, e.offset + rel
        b0[inside] = e.offset + rel // e.block * e.block
        b1[inside] = e.offset + np.minimum((rel // e.block + 1) * e.block, e.length)
    assert (obj >= 0).all() and len(keys) > obj.max(initial=0), "every byte of a shard is in an extent"
    return obj, at, b0, b1


def _rows_read(shard: ShardRecord, off: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray | None:
    """Which elements of ``shard`` a plan for box ``(off, shape)`` reads, by brute force over
    every element: the planner's unit is a row (first axis) of the shard, or of one of its tiles,
    so an element is read when its row meets the box and (tiled) its tile meets the box. None:
    the box misses the shard."""
    lo = [max(a, b) - b for a, b in zip(off, shard.offsets)]
    hi = [min(a + n, b + m) - b for a, n, b, m in zip(off, shape, shard.offsets, shard.shape)]
    if any(a >= b for a, b in zip(lo, hi)):
        return None
    if not shard.shape:
        return np.ones((), bool)
    idx = np.indices(shard.shape)
    mask = (idx[0] >= lo[0]) & (idx[0] < hi[0])
    for d in range(1, len(shard.shape)):
        if shard.tile is not None:
            start = idx[d] // shard.tile[d] * shard.tile[d]
            mask &= (start < hi[d]) & (start + shard.tile[d] > lo[d])
    return mask


def materialised(item: ArrayItem, objects: dict[str, bytes]) -> np.ndarray:
    """The saved array, built from the objects' bytes through :func:`_byte_places`."""
    keys = list(objects)
    blobs = [np.frombuffer(objects[k], np.uint8) for k in keys]
    out = np.zeros((*item.shape, item.dtype.itemsize), np.uint8)
    for s in item.shards:
        obj, at, _b0, _b1 = _byte_places(item, s, keys)
        part = np.zeros(obj.shape, np.uint8)
        for o, blob in enumerate(blobs):
            part[obj == o] = blob[at[obj == o]]
        out[tuple(slice(a, a + n) for a, n in zip(s.offsets, s.shape))] = part
    return out.view(item.dtype).reshape(item.shape)


def needed(item: ArrayItem, keys: list[str], off: tuple[int, ...], shape: tuple[int, ...]
           ) -> dict[tuple[str, int], int]:
    """The bytes a plan for box ``(off, shape)`` must read, as ``(object, offset)``: every checksum
    block that holds a byte of an element it reads (:func:`_rows_read`; a byte cannot be used
    before its block is verified). Each with how often it may be read: once, or once per tile of
    one shard with bytes to read in its block (each tile's rows are planned apart, and two tiles'
    rows can share a block)."""
    tiles: dict[tuple[int, int, int], set[int]] = {}
    for n, s in enumerate(item.shards):
        mask = _rows_read(s, off, shape)
        if mask is None:
            continue
        obj, _at, b0, b1 = (a[mask] for a in _byte_places(item, s, keys))
        tile = np.zeros(mask.shape, np.int64)
        if s.tile is not None:  # which tile of the shard each element is in, as one number
            grid = np.indices(s.shape) // np.reshape(s.tile, (-1,) + (1,) * len(s.shape))
            tile = np.ravel_multi_index(tuple(grid), tuple(-(-a // t) for a, t in zip(s.shape, s.tile)))
        tile = np.broadcast_to(tile[mask][..., None], obj.shape)
        for o, a, b, t in set(zip(obj.ravel().tolist(), b0.ravel().tolist(), b1.ravel().tolist(),
                                  tile.ravel().tolist())):
            tiles.setdefault((o, a, b), set()).add(n * (1 << 32) + t)
    return {(keys[o], x): len(ts) for (o, a, b), ts in tiles.items() for x in range(a, b)}


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


def _times_read(reqs: list) -> collections.Counter[tuple[str, int]]:
    """How often the requests read each ``(object, offset)``."""
    return collections.Counter((r.key, x) for r in reqs for x in range(r.rng.start, r.rng.end))


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
def test_reads_exactly_the_needed_bytes_once_and_restores_bit_exact(data: st.DataObject) -> None:
    item, full, objects, bs = data.draw(saved())
    keys = list(objects)
    saved_array = materialised(item, objects)
    assert saved_array.tobytes() == full.tobytes()  # the oracle's map of the objects is the saver's
    for off, shape in data.draw(target(item.shape)):
        reqs = plan_region("x", item, Region(off, np.zeros(shape, item.dtype)), keys, bs)
        want, got = needed(item, keys, off, shape), _times_read(reqs)
        assert got.keys() == want.keys()  # exactly the needed bytes
        assert all(n <= want[at] for at, n in got.items()), "a byte read more often than its block's tiles"
        dest = np.full(shape, 77, item.dtype)
        execute(plan_region("x", item, Region(off, dest), keys, bs), objects)
        assert dest.tobytes() == saved_array[tuple(slice(o, o + n) for o, n in zip(off, shape))].tobytes()
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
    got = from_columns(root, _gathered(root, cols), "root", complete=True)["x"]
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


def _gathered(root: Manifest, fragments: list[tuple[int, int, Columns]]) -> dict:
    """The columns of ``fragments`` (fragment, first object, columns) gathered as a loader does."""
    gather = Gather(list(root.items), None, len(fragments))
    for f, base, c in fragments:
        gather.add(f, base, c)
    return gather.done()


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
        from_columns(root, _gathered(root, [(0, 0, decode_columns(doc, "frag f"))]), "root", complete=True)

    load(shard)  # as written: fine
    with pytest.raises(ManifestError, match="frag f"):
        load(shard, extents=2)
    with pytest.raises(ManifestError, match="item 'x'"):  # a box the root does not assign it: not whole
        load({**shard, "offsets": [1, 0]})
    with pytest.raises(ManifestError, match="exactly its bytes"):
        load({**shard, "extents": [[0, 0, 0, 60, [1]]]})
    with pytest.raises(ManifestError, match="does not list"):
        load({**shard, "extents": [[1, 0, 0, 64, [1]]]})


def test_a_gathered_table_and_a_parsed_one_of_one_layout_share_their_planned_segments(monkeypatch) -> None:
    """A table gathered from columnar fragments and one parsed from shard records, of the same
    boxes and tiles, have one geometry key, whatever the fragment's width (a 1-d array beside a
    2-d one is padded there): planned together, their segments are found once and both restore
    bit-exact."""
    bs = 16
    layouts = {"m": ((4, 6), [((0, 0), (2, 6), None), ((2, 0), (2, 6), (1, 3))]),
               "v": ((8,), [((0,), (4,), None), ((4,), (4,), None)])}
    blob, fulls, parsed, rows = b"", {}, {}, []
    for name, (shape, boxes) in layouts.items():
        full = fulls[name] = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) + len(blob)
        shards, listed = [], []
        for off, sh, tile in boxes:
            data = _stream(full[tuple(slice(o, o + n) for o, n in zip(off, sh))], tile)
            crcs = block_crcs(memoryview(data), bs)
            shards.append(ShardRecord(off, sh, 0, [Extent(0, len(blob), 0, len(data), crcs, bs)], tile))
            listed.append({"offsets": list(off), "shape": list(sh), "extents": [[0, len(blob), 0, len(data), crcs, bs]],
                           **({"tile": list(tile)} if tile else {})})
            blob += data
        parsed[name] = ArrayItem(np.dtype(np.float32), shape, shards)
        rows.append((name, listed))
    root_items = {}
    for name, (shape, boxes) in layouts.items():
        root_items[name] = ArrayItem(np.dtype(np.float32), shape, [])
        root_items[name].locator = np.array([[0, *off, *sh] for off, sh, _t in boxes], np.int64)
    root = Manifest(1, "c", 0.0, bs, 1, None, root_items, [], fragments=[FragmentRef("f", 0, 0, 0)], complete=False)
    doc = {"objects": ["o"], **encode_columns(rows)}
    assert doc["width"] == 2
    gathered = from_columns(root, _gathered(root, [(0, 0, decode_columns(doc, "frag f"))]), "root", complete=True)
    found = []
    monkeypatch.setattr(reshard, "_add_segments", lambda segs, wi, w, real=reshard._add_segments: (
        found.append(w.name), real(segs, wi, w))[1])
    for name, (shape, _boxes) in layouts.items():
        g, p = gathered[name], parsed[name]
        assert g.table is not None and g.table.geometry() == reshard.table_of(p).geometry()
        off = (1,) * len(shape)
        box = tuple(n - 1 for n in shape)
        dests = [np.zeros(box, np.float32), np.zeros(box, np.float32)]
        found.clear()
        reqs = plan_regions([("g", g, Region(off, dests[0])), ("p", p, Region(off, dests[1]))], ["o"], bs)
        assert found == ["g"]  # the parsed table's segments were the gathered one's, repeated
        execute(reqs, {"o": blob})
        want = fulls[name][tuple(slice(o, o + n) for o, n in zip(off, box))]
        assert all(d.tobytes() == want.tobytes() for d in dests)
