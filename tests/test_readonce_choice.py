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
from test_boxexchange import BF16, COLS, ROWS, SAVED, _item, _Keys, _rows, _save, full
from test_readonce import _Host, on_hosts

import ckptio
from ckptio.backends import open_backend
from ckptio.engine import run_sync
from ckptio.restore import restore_step
from ckptio.restore.boxroute import TargetTable, apart
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
