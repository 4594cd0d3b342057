"""One round of a restore exchange (:mod:`ckptio.restoring.boxexchange`) on host 0 of a large job: CPU.

Rows -> columns at HOSTS hosts: an array of ``(HOSTS*R, HOSTS*C)`` float32 saved as HOSTS row
shards of R rows; host ``h`` restores the column block ``[C*h, C*h + C)`` of every row. Host 0
packs its shard's band into HOSTS strided pieces (R rows x C columns, one per host) and receives
HOSTS pieces (one from each host). Storage reads, the status round and the network are stubbed:
the figures are the CPU of planning the round's buffers, packing, sealing, landing and checking,
the part that grows with the number of hosts. The defaults are the 4096-host case of issue #32.

    python -m ckptio.bench.exchange_round [HOSTS [R [C]]]

It uses only ``boxexchange._round`` and its ``_Side``, which older trees have too: run it from a
worktree of main (``python /path/to/this/file``) to compare.
"""

from __future__ import annotations

import resource
import sys
import time
import types
from typing import Any
from unittest import mock

import numpy as np

__all__ = ["run_round"]


class _Loopback:
    """Host 0 of ``size``: receives zeros with a valid seal from every host (the seal is checked)."""

    def __init__(self, size: int) -> None:
        self.rank, self.size, self.stub_s, self.sent, self.buffers = 0, size, 0.0, 0, 0

    def exchange_into(self, out: dict[int, list[memoryview]], sizes: dict[int, list[int]],
                      into: dict[int, list[memoryview]]) -> None:
        from ckptio.system.checksum import crc32c

        t = time.process_time()
        for views in into.values():
            value = 0
            for b in views[1:-1]:
                value = crc32c(b, value)
            views[-1][:] = value.to_bytes(4, "little")
        self.stub_s += time.process_time() - t  # the network's part, not the round's
        self.sent = sum(sum(b.nbytes for b in bufs) for bufs in out.values())
        self.buffers = sum(len(bufs) for bufs in out.values())


def run_round(hosts: int = 4096, rows: int = 64, cols: int = 4, repeats: int = 5) -> dict[str, Any]:
    """CPU seconds of host 0's round (min and median of ``repeats``) and its page faults, as a
    restore's first round and as a later one; the bytes and buffers it sends."""
    from ckptio.restoring import boxexchange as bx
    from ckptio.restoring.boxroute import Pieces, TargetTable
    from ckptio.restoring.reshard_reads import Region

    i64, dtype = np.int64, np.dtype(np.float32)
    hs = np.arange(hosts, dtype=i64)
    zero = np.zeros(hosts, i64)
    table = TargetTable.from_columns(hs, np.column_stack([zero, hs * cols]), np.tile([hosts * rows, cols], (hosts, 1)))
    sends = Pieces(zero, hs, np.column_stack([zero, hs * cols]), np.column_stack([np.full(hosts, rows, i64),
                   hs * cols + cols]), zero, zero, np.full(hosts, rows, i64))
    gets = Pieces(hs, zero, np.column_stack([hs * rows, zero]), np.column_stack([hs * rows + rows,
                  np.full(hosts, cols, i64)]), zero, hs * rows, np.full(hosts, rows, i64))
    local = types.SimpleNamespace(items={"w": types.SimpleNamespace(dtype=dtype)}, objects={}, block_size=4 << 20)
    store = types.SimpleNamespace(engine=types.SimpleNamespace(read=lambda *a, **k: None))
    out: dict[str, Any] = {"hosts": hosts, "rows": rows, "cols": cols}
    with mock.patch.object(bx, "_agree", lambda *a, **k: 0), mock.patch.object(bx, "run_sync", lambda x: None), \
            mock.patch.object(bx, "plan_regions", lambda *a, **k: []):
        for later in (False, True):  # a restore's first round, then rounds after one (its buffers kept, if it keeps any)
            times, faults, coord, kept = [], 0, _Loopback(hosts), None
            for _ in range(repeats + later):
                target = np.zeros((hosts * rows, cols), dtype)
                side = bx._Side({"w": {(0, 0, hosts * rows, cols): [Region((0, 0), target)]}}, {"w": sends},
                                {"w": gets}, local, {"w": table})  # type: ignore[arg-type]
                if later and hasattr(side, "pages"):
                    kept = side.pages = kept or side.pages
                coord = _Loopback(hosts)
                f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                bx._round(store, coord, side, [("w", 0, 1)])  # type: ignore[arg-type]
                times.append(time.process_time() - t0 - coord.stub_s)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            times = times[later:]  # later rounds: not the one that made the buffers
            key = "later" if later else "first"
            out.update({f"{key}_cpu_min_s": min(times), f"{key}_cpu_median_s": sorted(times)[len(times) // 2],
                        f"{key}_faults": faults})
    return {**out, "sent_bytes": coord.sent, "buffers": coord.buffers}


if __name__ == "__main__":
    r = run_round(*(int(a) for a in sys.argv[1:4]))
    print(f"hosts={r['hosts']} piece={r['rows']}x{r['cols']} float32, sent {r['sent_bytes']} B in {r['buffers']} "
          "buffers; round CPU min / median, page faults: " + "; ".join(
              f"{k} {r[f'{k}_cpu_min_s']:.4f} / {r[f'{k}_cpu_median_s']:.4f} s, {r[f'{k}_faults']}"
              for k in ("first", "later")))
