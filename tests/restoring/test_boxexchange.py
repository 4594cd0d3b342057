"""Logical-box exchange (ckptio.restoring.boxroute plans, ckptio.restoring.boxexchange moves bytes).

Properties of the routing over random saved grids x target grids x host counts (both ends list
the same pieces in the same order, every round's bands too; each host's pieces tile exactly its
target boxes), then restores on thread hosts exchanging bytes: bit-exact, each stored data byte
read once across the job, each host reading the root and only the fragments it sends from (also
over random saved x target grids, uneven shapes and dtypes), and a flipped stored byte an
IntegrityError on every host.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hosts import on_hosts as saving_hosts
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import WORKERS
from tests.restoring.test_reshard_properties import _cuts
from tests.restoring.test_reshard_properties import _grid as _cells
from tests.restoring.test_readonce import on_hosts as exchanging_hosts

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.wrappers import CountingBackend, WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import IntegrityError
from ckptio.manifest import ArrayItem, ShardRecord
from ckptio.restoring import packing
from ckptio.restoring.boxexchange import restore_exchange
from ckptio.restoring.boxroute import TargetTable, incoming, outgoing, responsible
from ckptio.store import CheckpointStore, StoreOptions

PROFILE = settings(max_examples=60, derandomize=True, deadline=None)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Any], list[int], int, TargetTable]:
    """A shape, its saved shards (a grid) with the fragment of each, a restoring job's size and
    every host's target boxes (a grid with replicas, or arbitrary boxes per host)."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    saved = _cells([_cuts(draw, n, 3) for n in shape])
    frags = draw(st.integers(1, 6))
    owner = [draw(st.integers(0, frags - 1)) for _ in saved]
    hosts = draw(st.integers(1, 7))
    if draw(st.booleans()):
        block = tuple(draw(st.integers(1, n)) for n in shape)
        counts = [-(-n // b) for n, b in zip(shape, block)]
        reps = draw(st.integers(1, 3))
        grid = np.array(draw(st.lists(st.integers(-1, hosts - 1), min_size=math.prod(counts) * reps,
                                      max_size=math.prod(counts) * reps)), np.int64)
        tt = TargetTable.grid(shape, block, grid.reshape(*counts, reps))
    else:
        per: dict[int, list[Any]] = {}
        for h in range(hosts):
            for _ in range(draw(st.integers(0, 2))):
                off = tuple(draw(st.integers(0, n - 1)) for n in shape)
                per.setdefault(h, []).append((off, tuple(draw(st.integers(1, n - o)) for o, n in zip(off, shape))))
        tt = TargetTable.from_boxes(per, ndim)
    return shape, saved, owner, hosts, tt


def _item(shape: tuple[int, ...], boxes: list[Any]) -> ArrayItem:
    return ArrayItem(np.dtype(np.float32), shape, [ShardRecord(o, s, 0, [], None) for o, s in boxes])


def _cols(p: Any, keep: np.ndarray) -> list[tuple[Any, ...]]:
    return list(zip(p.src[keep].tolist(), p.dst[keep].tolist(), p.lo[keep].tolist(), p.hi[keep].tolist(),
                    p.s0[keep].tolist(), p.sn[keep].tolist()))


@PROFILE
@given(layouts(), st.integers(1, 5))
def test_senders_and_receivers_list_the_same_pieces_and_each_host_gets_exactly_its_boxes(
        layout: Any, bands: int) -> None:
    shape, saved, owner, hosts, tt = layout
    ndim = len(shape)
    locator = np.array([(f, *o, *s) for f, (o, s) in zip(owner, saved)], np.int64).reshape(len(saved), 1 + 2 * ndim)
    root_item = _item(shape, saved)
    root_item.locator = locator
    root_items = {"a": root_item}
    frags = max(owner) + 1
    sent: dict[tuple[int, int], list[Any]] = {}
    for rank in range(hosts):
        mine = set(responsible(frags, hosts, rank))
        local = {"a": _item(shape, [b for f, b in zip(owner, saved) if f in mine])}
        for k in range(bands):
            for p in (p.band(k, bands) for p in outgoing(local, {"a": tt}, rank).values()):  # type: ignore[arg-type]
                assert (p.src == rank).all()
                for dst in np.unique(p.dst).tolist():
                    sent.setdefault((rank, dst, k), []).extend(_cols(p, p.dst == dst))
    got: dict[tuple[int, int], list[Any]] = {}
    for rank in range(hosts):
        pieces = incoming(root_items, {"a": tt}, rank, hosts).get("a")  # type: ignore[arg-type]
        covered = np.zeros(len(tt.host), np.int64)
        for k in range(bands):
            if pieces is None:
                continue
            p = pieces.band(k, bands)
            for src in np.unique(p.src).tolist():
                got.setdefault((src, rank, k), []).extend(_cols(p, p.src == src))
            np.add.at(covered, p.ref, np.prod(p.hi - p.lo, axis=1, dtype=np.int64))
            # Each piece lies inside the target box it is for.
            assert (p.lo >= tt.offsets[p.ref]).all() and (p.hi <= tt.offsets[p.ref] + tt.shape[p.ref]).all()
        # The saved shards tile the array: a host's pieces fill each of its boxes exactly once.
        boxes = np.flatnonzero(tt.host == rank)
        assert covered[boxes].tolist() == np.prod(tt.shape[boxes], axis=1, dtype=np.int64).tolist()
    # Both ends of every message list the same pieces in the same order, band by band.
    assert sent == got


@PROFILE
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.integers(1, 4), st.data())
def test_a_grid_lists_every_cell_with_its_hosts(shape: list[int], reps: int, data: st.DataObject) -> None:
    block = [data.draw(st.integers(1, n)) for n in shape]
    counts = [-(-n // b) for n, b in zip(shape, block)]
    hosts = np.array(data.draw(st.lists(st.integers(-1, 5), min_size=math.prod(counts) * reps,
                                        max_size=math.prod(counts) * reps))).reshape(*counts, reps)
    tt = TargetTable.grid(shape, block, hosts)
    want = set()
    for cell in itertools.product(*(range(c) for c in counts)):
        off = tuple(i * b for i, b in zip(cell, block))
        box = (off, tuple(min(b, n - o) for b, n, o in zip(block, shape, off)))
        want |= {(h, box) for h in hosts[cell].tolist() if h >= 0}
    assert {(h, b) for h in range(6) for b in tt.of_host(h)} == want


# -- restores on thread hosts ---------------------------------------------------------------------

SAVED = 4
ROWS, COLS = 64, 48
BF16 = np.dtype(ml_dtypes.bfloat16)


def full(name: str) -> np.ndarray:
    rng = np.random.default_rng(sum(map(ord, name)))
    if name == "bias":
        return np.arange(1000, dtype=np.int64)
    return rng.standard_normal((ROWS, COLS)).astype(BF16 if name == "mu" else np.float32)


def _rows(rank: int, hosts: int) -> slice:
    n = ROWS // hosts
    return slice(rank * n, (rank + 1) * n)


def _save(root: Path, steps: tuple[int, ...] = (1,)) -> None:
    def state(rank: int) -> dict[str, Any]:
        ix = (_rows(rank, SAVED), slice(None))
        return {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, full("w")[ix])]),
                "mu": ckptio.Sharded((ROWS, COLS), BF16, [(ix, full("mu")[ix])]), "bias": full("bias"), "step": 3}

    for step in steps:
        saving_hosts(SAVED, lambda rank, coord: ckptio.save(str(root), state(rank), step=step,
                                                             coordinator=coord).result())


def _columns(rank: int, hosts: int) -> tuple[slice, slice]:
    c0, c1 = COLS * rank // hosts, COLS * (rank + 1) // hosts  # uneven blocks when hosts does not divide 48
    return (slice(None), slice(c0, c1))


def _target(rank: int, hosts: int) -> dict[str, Any]:
    ix = _columns(rank, hosts)
    return {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)]),
            "mu": ckptio.Sharded((ROWS, COLS), BF16, [(ix, None)]), "bias": None, "step": None}


class _Keys(WrapperBackend):
    """Names every object read and counts the bytes read of data objects (not metadata)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.keys: set[str] = set()
        self.data = 0

    async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
        self.keys.add(key)
        await self.inner.read_into(key, rng, buffers)
        if "/ckptio." not in key:
            self.data += rng.length


def _tables(hosts: int) -> dict[str, TargetTable]:
    """Every host's target boxes, said without an all-gather: ``w`` and ``mu`` as column blocks
    (uneven), ``bias`` whole on every host."""
    h = np.arange(hosts)
    c0, c1 = COLS * h // hosts, COLS * (h + 1) // hosts
    cols = TargetTable.from_columns(h, np.column_stack([0 * h, c0]), np.column_stack([0 * h + ROWS, c1 - c0]))
    return {"w": cols, "mu": cols, "bias": TargetTable.grid((1000,), (1000,), h.reshape(1, hosts))}


def _exchange(root: Path, backend: Any, target: Any, host: Any, step: int = 1, **kw: Any) -> Any:
    """One host's ``restore_exchange`` of ``step`` of ``root`` read through ``backend``."""
    store = CheckpointStore(StoreOptions(str(root), backend=backend))
    try:
        step_dir, m = run_sync(store.resolve_manifest(step, shards=False))
        return restore_exchange(store, m, step_dir, target, host, **kw)
    finally:
        run_sync(store.close())


def _restore_on(root: Path, hosts: int, step: int = 1, tables: dict[str, TargetTable] | None = None) -> list[Any]:
    def body(rank: int, host: Any) -> Any:
        counting = CountingBackend(open_backend(str(root)))
        keys = _Keys(counting)
        out = _exchange(root, keys, _target(rank, hosts), host, step, targets=tables)
        return out, counting.bytes_read, keys.keys

    return exchanging_hosts(hosts, body)


def _data_bytes(root: Path, step: int = 1) -> int:
    return sum(p.stat().st_size for p in (root / str(step)).iterdir() if not p.name.startswith("ckptio."))


def _meta_bytes(root: Path, step: int = 1) -> int:
    """The step's metadata: its manifest, fragments, fence."""
    return sum(p.stat().st_size for p in (root / str(step)).iterdir() if p.name.startswith("ckptio."))


def test_rows_restored_as_columns_by_exchange_read_each_stored_byte_once(tmp_path: Path) -> None:
    _save(tmp_path)
    # Fewer hosts (each sends several fragments), as many, more; every host's target boxes
    # all-gathered, or said by tables every host makes.
    for hosts, tables in ((2, None), (3, None), (4, None), (6, None), (3, _tables(3)), (6, _tables(6))):
        results = _restore_on(tmp_path, hosts, tables=tables)
        for rank, r in enumerate(results):
            assert not isinstance(r, BaseException), r
            out, _read, keys = r
            ix = _columns(rank, hosts)
            for name in ("w", "mu"):
                assert out[name].pieces[0][1].tobytes() == np.ascontiguousarray(full(name)[ix]).tobytes()
            assert out["bias"].tobytes() == full("bias").tobytes() and out["step"] == 3
            # The root and the fragments this host sends from, never another's.
            frags = {k for k in keys if "ckptio.fragment." in k}
            assert len(frags) == len(responsible(SAVED, hosts, rank)), (hosts, rank, frags)
        total = sum(r[1] for r in results)
        # Every data byte once across the job; each host reads the root (and its fragments) itself.
        assert _data_bytes(tmp_path) <= total <= _data_bytes(tmp_path) + hosts * _meta_bytes(tmp_path)


def test_progress_is_fed_the_bytes_each_host_restores_by_exchange(tmp_path: Path) -> None:
    """Rows restored as columns move every column block by exchange: each host's progress callback
    hears at least the bytes of its blocks (received pieces), and only "read" events."""
    _save(tmp_path)
    hosts = 3

    def body(rank: int, host: Any) -> Any:
        events: list[tuple[str, int]] = []
        out = _exchange(tmp_path, open_backend(str(tmp_path)), _target(rank, hosts), host,
                        progress=lambda event, n: events.append((event, n)))
        return out, events

    for rank, r in enumerate(exchanging_hosts(hosts, body)):
        assert not isinstance(r, BaseException), r
        out, events = r
        blocks = sum(out[n].pieces[0][1].nbytes for n in ("w", "mu"))
        assert {e for e, _ in events} == {"read"}
        # The blocks came by exchange (no host reads its own columns from storage), plus bias.
        assert blocks + full("bias").nbytes <= sum(n for _, n in events) <= blocks + _data_bytes(tmp_path)


class _Flip(WrapperBackend):
    """Every read of a data object comes back with its first byte flipped."""

    async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
        await self.inner.read_into(key, rng, buffers)
        if "/ckptio." not in key:
            buffers[0].cast("B")[0] ^= 1


def test_a_flipped_stored_byte_is_an_integrity_error_on_every_host(tmp_path: Path) -> None:
    _save(tmp_path)
    hosts = 3

    def body(rank: int, host: Any) -> Any:
        backend = open_backend(str(tmp_path))
        return _exchange(tmp_path, _Flip(backend) if rank == 1 else backend, _target(rank, hosts), host)

    results = exchanging_hosts(hosts, body)
    assert all(isinstance(r, IntegrityError) for r in results), results
    # Every host names the host that read the object and the object.
    assert all("host 1" in str(r) and "checksum mismatch in object '1/" in str(r) for r in results), results


@pytest.mark.parametrize("into", [True, False], ids=["landing-in-targets", "whole-messages"])
def test_a_byte_damaged_between_hosts_is_an_integrity_error_on_every_host(tmp_path: Path, into: bool) -> None:
    """Bytes are verified against the stored checksums where they are read; what one host sends
    another is sealed (crc32c), so damage in transit is caught where the bytes are used: received
    in place in the target buffers (a coordinator's ``exchange_into``) or as whole messages."""
    _save(tmp_path)
    hosts = 3

    class _Damaging:
        """Host 2's coordinator: the first piece byte it receives from host 0 is flipped."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.rank, self.size, self.done = inner, inner.rank, inner.size, False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def exchange(self, sends: Any, sizes: Any = None) -> Any:
            got = self.inner.exchange(sends, sizes)
            if not self.done and len(got.get(0, b"")) > 5:
                got[0][1] ^= 0x40
                self.done = True
            return got

        def exchange_into(self, sends: Any, sizes: Any, into: Any) -> None:
            self.inner.exchange_into(sends, sizes, into)
            if not self.done and len(into.get(0, [])) > 2:
                first = into[0][1].cast("B") if into[0][1].format != "B" else into[0][1]
                first[0] ^= 0x40  # where the bytes landed: a target buffer or staging
                self.done = True

    class _Whole(_Damaging):
        exchange_into = None  # a coordinator without it: whole messages, then copied in

    def body(rank: int, host: Any) -> Any:
        wrap = _Damaging if into else _Whole
        return _exchange(tmp_path, open_backend(str(tmp_path)), _target(rank, hosts),
                         wrap(host) if rank == 2 else host)

    results = exchanging_hosts(hosts, body)
    assert all(isinstance(r, IntegrityError) for r in results), results
    assert all("host 2" in str(r) and "host 0 sent" in str(r) and "arrived damaged" in str(r) for r in results), results
    # Undamaged, the same restore succeeds on every host (the seal itself is sound).
    assert not any(isinstance(r, BaseException) for r in _restore_on(tmp_path, hosts))


def test_a_checkpoint_saved_by_one_process_is_sent_shard_by_shard_from_several_hosts(tmp_path: Path) -> None:
    # Format 1 (every shard in the one manifest): shard i is sent by host i % H.
    pieces = [((_rows(i, SAVED), slice(None)), full("w")[_rows(i, SAVED)]) for i in range(SAVED)]
    ckptio.save(str(tmp_path), {"w": ckptio.Sharded((ROWS, COLS), np.float32, pieces), "bias": full("bias")},
                step=1).result()
    hosts = 3

    def body(rank: int, host: Any) -> Any:
        counting = CountingBackend(open_backend(str(tmp_path)))
        target = {"w": _target(rank, hosts)["w"], "bias": None}
        return _exchange(tmp_path, counting, target, host), counting.bytes_read

    results = exchanging_hosts(hosts, body)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r[0]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(full("w")[_columns(rank, hosts)]).tobytes()
        assert r[0]["bias"].tobytes() == full("bias").tobytes()
    assert _data_bytes(tmp_path) <= sum(r[1] for r in results) <= _data_bytes(tmp_path) + hosts * _meta_bytes(tmp_path)


def test_target_tables_that_disagree_with_a_host_s_target_fail_every_host_naming_the_item(tmp_path: Path) -> None:
    _save(tmp_path)
    tables = _tables(3)
    tables["mu"] = _tables(2)["mu"]  # column blocks of a job of 2
    results = _restore_on(tmp_path, 3, tables=tables)
    assert all(isinstance(r, ValueError) and "'mu'" in str(r) for r in results), results


def test_a_box_a_host_holds_twice_is_filled_twice(tmp_path: Path) -> None:
    _save(tmp_path)

    def body(rank: int, host: Any) -> Any:
        ix = _columns(rank, 2)
        target = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None), (ix, None)])}
        return _exchange(tmp_path, open_backend(str(tmp_path)), target, host)

    for rank, r in enumerate(exchanging_hosts(2, body)):
        assert not isinstance(r, BaseException), r
        want = np.ascontiguousarray(full("w")[_columns(rank, 2)]).tobytes()
        assert [p[1].tobytes() for p in r["w"].pieces] == [want, want]


@contextlib.contextmanager
def _cut(small: int, group: int, many: int) -> Iterator[None]:
    """Messages cut, and pieces copied, with these thresholds (read when a round starts)."""
    was = packing.SMALL, packing.GROUP, packing.MANY
    packing.SMALL, packing.GROUP, packing.MANY = small, group, many
    try:
        yield
    finally:
        packing.SMALL, packing.GROUP, packing.MANY = was


DTYPES = [np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.float32), np.dtype(np.float64), BF16]


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.data())
def test_random_saved_and_target_grids_restore_bit_exact_reading_each_stored_byte_once_or_as_a_plain_restore(
        tmp_path_factory: Any, data: st.DataObject) -> None:
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    dtype = data.draw(st.sampled_from(DTYPES))
    arr = np.arange(math.prod(shape), dtype=np.int64).astype(dtype).reshape(shape)
    saved, hosts = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cells = _cells([data.draw(st.just(c)) for c in [_cuts(data.draw, n, 2) for n in shape]])
    owner = [data.draw(st.integers(0, saved - 1)) for _ in cells]
    wanted = [[c for c in _cells([_cuts(data.draw, n, 2) for n in shape]) if data.draw(st.booleans())]
              for _ in range(hosts)]
    root = tmp_path_factory.mktemp("grids")
    # Message buffers cut as in a large restore (pieces alone, runs of small ones, direct and staged).
    small, group = data.draw(st.sampled_from([(packing.SMALL, packing.GROUP), (1, 1), (8, 24), (40, 1 << 20)]))
    many = data.draw(st.sampled_from([packing.MANY, 0, 2]))  # pieces copied whole, or as runs

    def ix(box: Any) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(*box))

    def state(rank: int) -> dict[str, Any]:
        mine = [(ix(c), arr[ix(c)]) for c, o in zip(cells, owner) if o == rank]
        return {"a": ckptio.Sharded(shape, dtype, mine)}

    saving_hosts(saved, lambda rank, coord: ckptio.save(str(root), state(rank), step=1, coordinator=coord).result())

    def body(rank: int, host: Any) -> Any:
        reads = _Keys(open_backend(str(root)))
        target = {"a": ckptio.Sharded(shape, dtype, [(ix(c), None) for c in wanted[rank]])}
        return _exchange(root, reads, target, host), reads.data

    with _cut(small, group, many):
        results = exchanging_hosts(hosts, body)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert [p[1].tobytes() for p in r[0]["a"].pieces] == [arr[ix(c)].tobytes() for c in wanted[rank]]
    # All stored bytes read when the targets cover the array.
    covered = np.zeros(shape, bool)
    for boxes in wanted:
        for c in boxes:
            covered[ix(c)] = True
    total = sum(r[1] for r in results)
    # Arrays no two hosts share (boxroute.apart) each host reads as a plain restore does (a
    # checksum block holding two boxes' bytes read for each); the others, each stored byte once.
    plain = 0
    for rank in range(hosts):
        reads = _Keys(open_backend(str(root)))
        ckptio.restore(str(root), 1, {"a": ckptio.Sharded(shape, dtype, [(ix(c), None) for c in wanted[rank]])},
                       backend=reads, read_once=False)
        plain += reads.data
    assert (total <= arr.nbytes or total == plain) and (total >= arr.nbytes or not covered.all())


def test_jax_targets_say_every_host_s_boxes_from_their_shardings(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("jax")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    worker = str(WORKERS / "boxexchange_jax_worker.py")
    run = subprocess.run([sys.executable, worker, str(tmp_path / "ckpt")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
