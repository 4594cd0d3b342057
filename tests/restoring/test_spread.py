"""A replicated array restored by logical-box exchange is read and sent by several hosts, not one
(ckptio/restore/spread.py, #32): each band of its one stored shard by another host. Hosts as
threads; format 1 (saved by one process) and format 2 (a root + a fragment per saving host)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts as saving_hosts
from tests.restoring.test_readonce import _Host, on_hosts

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.wrappers import CountingBackend
from ckptio.engine import run_sync
from ckptio.restoring.boxexchange import restore_exchange
from ckptio.store import CheckpointStore, StoreOptions

HOSTS = 4
EMB = np.random.default_rng(21).standard_normal(1 << 20, dtype=np.float32)  # 4 MiB: cut into bands
BIAS = np.arange(1000, dtype=np.int64)  # one small band


def _save(root: Path, format2: bool) -> None:
    if format2:  # host 0 writes the replicated arrays; every host a small part of "w"
        def state(rank: int) -> dict[str, Any]:
            part = np.full((1, 8), rank, np.float32)
            return {"emb": EMB, "bias": BIAS,
                    "w": ckptio.Sharded((HOSTS, 8), np.float32, [((slice(rank, rank + 1), slice(None)), part)])}

        saving_hosts(HOSTS, lambda rank, coord: ckptio.save(str(root), state(rank), step=1, coordinator=coord).result())
    else:
        ckptio.save(str(root), {"emb": EMB, "bias": BIAS}, step=1).result()


class _Counted(_Host):
    """A thread host that counts the bytes it sends to other hosts."""

    sent = 0

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        self.sent += sum(b.nbytes for dst, bufs in sends.items() if dst != self.rank for b in bufs)
        return super().exchange(sends, sizes)


def _restore(root: Path) -> list[Any]:
    def body(rank: int, host: _Host) -> Any:
        host.__class__ = _Counted
        counting = CountingBackend(open_backend(str(root)))
        store = CheckpointStore(StoreOptions(str(root), backend=counting))
        try:
            step_dir, m = run_sync(store.resolve_manifest(1, shards=False))
            out = restore_exchange(store, m, step_dir, {"emb": None, "bias": None}, host)
        finally:
            run_sync(store.close())
        return out, counting.bytes_read, host.sent  # type: ignore[attr-defined]

    return on_hosts(HOSTS, body)


@pytest.mark.parametrize("format2", [False, True])
def test_a_replicated_array_is_read_once_and_sent_by_several_hosts_bit_exact(tmp_path: Path, format2: bool) -> None:
    _save(tmp_path, format2)
    results = _restore(tmp_path)
    for r in results:
        assert not isinstance(r, BaseException), r
        out, _read, _sent = r
        assert out["emb"].tobytes() == EMB.tobytes() and out["bias"].tobytes() == BIAS.tobytes()
    data = sum(p.stat().st_size for p in (tmp_path / "1").iterdir() if not p.name.startswith("ckptio."))
    meta = sum(p.stat().st_size for p in (tmp_path / "1").iterdir() if p.name.startswith("ckptio."))
    assert sum(r[1] for r in results) <= 1.1 * data + HOSTS * meta  # each stored byte read once
    sent = [r[2] for r in results]
    # One sender would send all of emb to the 3 others; its bands spread over every host.
    assert max(sent) <= EMB.nbytes * (HOSTS - 1) // HOSTS + (64 << 10), sent
    assert sum(s > 0 for s in sent) == HOSTS, sent
