"""Read-once restores choose per array between each host reading its own bytes and the exchange.

``boxroute.apart`` says, from the root and every host's target tables alone (so every host
decides alike), which arrays no two hosts share; ``read_once=True`` restores those as a plain
restore does (no fragment but the ones the host's boxes meet, nothing sent) and exchanges the
rest (rows -> columns, replicas). Same layout and N -> N/2 here on thread hosts; the 8-process
rows -> columns default of ``CheckpointManager.restore()`` is in test_boxexchange_mp.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.restoring.test_boxexchange import (
    BF16,
    COLS,
    ROWS,
    SAVED,
    _item,
    _Keys,
    _rows,
    _save,
    full,
    layouts,
)
from tests.restoring.test_readonce import _Host, on_hosts

import ckptio
from ckptio.backends import open_backend
from ckptio.engine import run_sync
from ckptio.restoring import restore_step
from ckptio.restoring.boxroute import TargetTable, apart
from ckptio.store import CheckpointStore, StoreOptions


def _row_blocks(n: int, parts: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [((n * i // parts, 0), (n * (i + 1) // parts - n * i // parts, 6)) for i in range(parts)]


def _table(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], hosts: list[int]) -> TargetTable:
    return TargetTable.from_boxes({h: [b for b, bh in zip(boxes, hosts) if bh == h] for h in set(hosts)}, 2)


def test_apart_holds_exactly_when_no_two_hosts_share_stored_bytes() -> None:
    saved = _item((12, 6), _row_blocks(12, 4))
    blocks = _item((12, 6), [((r, c), (6, 3)) for r in (0, 6) for c in (0, 3)])
    cases = {
        "same": (saved, _table(_row_blocks(12, 4), [0, 1, 2, 3]), True),
        "half": (saved, _table(_row_blocks(12, 2), [0, 1]), True),
        "double": (saved, _table(_row_blocks(12, 8), list(range(8))), True),
        "uneven rows": (saved, _table(_row_blocks(12, 5), list(range(5))), True),
        "blocks as saved": (blocks, _table([((r, c), (6, 3)) for r in (0, 6) for c in (0, 3)], [0, 1, 2, 3]), True),
        "one host": (saved, _table([((0, 0), (12, 6))], [0]), True),
        "columns": (saved, _table([((0, 0), (12, 3)), ((0, 3), (12, 3))], [0, 1]), False),
        "replicated": (saved, _table([((0, 0), (12, 6))] * 2, [0, 1]), False),
        "overlapping rows": (saved, _table([((0, 0), (7, 6)), ((6, 0), (6, 6))], [0, 1]), False),
        "rows of blocks": (blocks, _table(_row_blocks(12, 4), [0, 1, 2, 3]), False),
    }
    got = {name: bool(apart({"a": item}, {"a": tt})) for name, (item, tt, _) in cases.items()}
    assert got == {name: want for name, (_, _, want) in cases.items()}


def _contiguous(lo: np.ndarray, hi: np.ndarray, s_off: np.ndarray, s_shape: np.ndarray) -> bool:
    """Whether the box [lo, hi) of a stored shard is one run of its bytes (C order): after the
    first axis it spans more than one index of, every axis whole."""
    ext = hi - lo
    first = next((d for d in range(len(ext)) if ext[d] > 1), len(ext))
    return all(lo[d] == s_off[d] and ext[d] == s_shape[d] for d in range(first + 1, len(ext)))


@st.composite
def _choices(draw: st.DrawFn) -> tuple[Any, TargetTable]:
    """A saved grid and every host's target: random (test_boxexchange.layouts), the saved shards
    themselves on distinct hosts, or row slabs of rows saved."""
    shape, saved, _owner, _hosts, tt = draw(layouts())
    kind = draw(st.sampled_from(["random", "as saved", "row slabs"]))
    if kind == "as saved":
        hosts = draw(st.permutations(range(len(saved))))
        tt = TargetTable.from_boxes({h: [b] for h, b in zip(hosts, saved)}, len(shape))
    elif kind == "row slabs" and shape:
        saved = [((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:]) for a, b in _cuts_of(draw, shape[0])]
        slabs = _cuts_of(draw, shape[0])
        tt = TargetTable.from_boxes({h: [((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:])]
                                     for h, (a, b) in enumerate(slabs)}, len(shape))
    return _item(shape, saved), tt


def _cuts_of(draw: st.DrawFn, n: int) -> list[tuple[int, int]]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))) - {n})
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


@settings(max_examples=200, derandomize=True, deadline=None)
@given(_choices())
def test_apart_arrays_have_no_element_wanted_twice_and_each_stored_run_contiguous(choice: Any) -> None:
    item, tt = choice
    if not apart({"a": item}, {"a": tt}):
        return
    wanted = np.zeros(item.shape, np.int64)
    for off, shape in zip(tt.offsets.tolist(), tt.shape.tolist()):
        wanted[tuple(slice(o, o + n) for o, n in zip(off, shape))] += 1
    assert wanted.max(initial=0) <= 1 or int((np.prod(tt.shape, axis=1) > 0).sum()) <= 1
    for shard in item.shards:
        s_off, s_shape = np.array(shard.offsets, np.int64), np.array(shard.shape, np.int64)
        for off, shape in zip(tt.offsets, tt.shape):
            lo, hi = np.maximum(off, s_off), np.minimum(off + shape, s_off + s_shape)
            if (hi > lo).all() and len(tt.host) > 1:
                assert _contiguous(lo, hi, s_off, s_shape), (item.shape, shard, off, shape)


def test_the_saved_layout_and_row_slabs_of_rows_are_apart() -> None:
    rows = [((0, 0), (5, 4)), ((5, 0), (2, 4)), ((7, 0), (3, 4))]
    assert apart({"a": _item((10, 4), rows)}, {"a": _table([b for b, _ in [(r, 0) for r in rows]], [2, 0, 1])})
    assert apart({"a": _item((10, 4), rows)}, {"a": _table([((0, 0), (3, 4)), ((3, 0), (7, 4))], [1, 0])})


class _Counted(_Host):
    """A thread host that counts the bytes it sends in exchanges."""

    sent = 0

    def exchange(self, sends: dict[int, list[memoryview]], sizes: Any = None) -> dict[int, bytearray]:
        self.sent += sum(len(b) for bufs in sends.values() for b in bufs)
        return super().exchange(sends, sizes)


def _restore_rows(root: Path, hosts: int) -> list[Any]:
    def body(rank: int, host: Any) -> Any:
        keys = _Keys(open_backend(str(root)))
        store = CheckpointStore(StoreOptions(str(root), backend=keys))
        coord = _Counted(host.group, rank)
        ix = (_rows(rank, hosts), slice(None))
        target = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)]),
                  "mu": ckptio.Sharded((ROWS, COLS), BF16, [(ix, None)]), "step": None}
        try:
            out = restore_step(store, 1, target, coordinator=coord, read_once=True)
            return out, keys.data, keys.keys, coord.sent
        finally:
            run_sync(store.close())

    return on_hosts(hosts, body)


def _holding(root: Any, rows: slice) -> set[str]:
    """The names of the fragments holding stored shards of ``w`` that meet ``rows``."""
    loc = root.items["w"].locator
    meets = (loc[:, 1] < rows.stop) & (loc[:, 1] + loc[:, 3] > rows.start)
    return {root.fragments[f].key.rsplit("/", 1)[-1] for f in loc[meets, 0].tolist()}


def test_same_layout_and_half_the_hosts_read_their_own_fragments_and_send_nothing(tmp_path: Path) -> None:
    _save(tmp_path)
    root = run_sync(CheckpointStore(str(tmp_path)).read_manifest("1", shards=False))
    for hosts in (SAVED, SAVED // 2):
        results = _restore_rows(tmp_path, hosts)
        for rank, r in enumerate(results):
            assert not isinstance(r, BaseException), r
            out, _data, keys, sent = r
            ix = (_rows(rank, hosts), slice(None))
            for name in ("w", "mu"):
                assert out[name].pieces[0][1].tobytes() == np.ascontiguousarray(full(name)[ix]).tobytes()
            assert out["step"] == 3
            assert sent == 0, (hosts, rank, sent)
            # The fragments holding the rows it restores (from the root's locator), no other.
            assert {k.rsplit("/", 1)[1] for k in keys if "ckptio.fragment." in k} == _holding(root, ix[0]), \
                (hosts, rank, keys)
        # The stored bytes of w and mu (what the job restores), each read once in the job.
        assert sum(r[1] for r in results) == ROWS * COLS * (4 + 2), hosts
