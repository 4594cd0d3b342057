"""``--reshard``: a restore onto another sharding reads about what it asks for.

One square float32 array of ``--size`` bytes is saved as 16 row blocks (data
parallel) and, separately, as 16 column blocks (tensor parallel), once tiled
(1 MiB tiles, ckptio.engine.tiling: the default on shared storage -- GCS,
Parallelstore, Hyperdisk ML) and once in plain C order (``tile_bytes=0``: the
default on a local disk). Each checkpoint is then restored cold as one block of
each kind -- the same layout as saved, and the other one -- plus a column
block at an odd, non-dividing offset (one block wide: a tile-aligned layout
reads up to two tiles' width for it). Each restore runs in a fresh process
and reports the bytes it read against the bytes it needed (a counting
backend wrapper around the local backend), its time, that time over the
same checkpoint's same-layout restore (a row block of row-saved shards, a
column block of column-saved ones), and its peak RSS above the process's RSS
before it (``PeakRSS``). Last, N -> 2N: the array saved as 256 small row blocks
(4 MiB checksum blocks, as at 4096 hosts) and half of one restored, which reads
about what it needs now that small shards get checksum blocks of their own.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from ckptio.bench.report import print_table
from ckptio.bench.simhost import in_child
from ckptio.bench.system import PeakRSS, detect_cache_drop, drop_cache
from ckptio.engine.tiling import DEFAULT_TILE_BYTES

__all__ = ["render_reshard", "reshard_summary", "run_reshard"]

BLOCKS = 16


#: The N -> 2N case: the array saved as this many row blocks (shards smaller than a checksum block
#: at the sizes this bench runs), with the issue's 4 MiB block; a restore reads half of one of them.
SMALL_BLOCKS = 256
SMALL_BLOCK_SIZE = 4 << 20


def _blocks(n: int, kind: str, count: int = BLOCKS) -> list[tuple[slice, slice]]:
    step = n // count
    if kind == "rows":
        return [(slice(i * step, (i + 1) * step), slice(None)) for i in range(count)]
    return [(slice(None), slice(i * step, (i + 1) * step)) for i in range(count)]


def _array(n: int) -> np.ndarray:
    return np.arange(n * n, dtype=np.float32).reshape(n, n)


def _save_small(root: str, n: int, count: int, q: Any) -> None:
    """``count`` C-order row blocks, checksummed in the issue's 4 MiB blocks (the N -> 2N case)."""
    _save(root, n, "rows", 0, q, count, SMALL_BLOCK_SIZE)


def _save(root: str, n: int, kind: str, tile_bytes: int | None, q: Any, count: int = BLOCKS,
          block_size: int | None = None) -> None:
    import ckptio

    full = _array(n)
    pieces = [(ix, full[ix]) for ix in _blocks(n, kind, count)]
    config = ckptio.EngineConfig(**({"block_size": block_size} if block_size else {}))
    t0 = time.perf_counter()
    ckptio.save(root, {"w": ckptio.Sharded(full.shape, full.dtype, pieces)}, step=1, engine_config=config,
                save_options=ckptio.SaveOptions(tile_bytes=tile_bytes)).result()
    q.put({"save_s": time.perf_counter() - t0})


def _restore(root: str, n: int, index: tuple[slice, slice], cache: str, q: Any) -> None:
    import ckptio
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    drop_cache(cache, root)
    counting = CountingBackend(open_backend(root))
    target = {"w": ckptio.Sharded((n, n), np.float32, [(index, None)])}
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        out = ckptio.restore(root, step=1, target=target, backend=counting)
        seconds = time.perf_counter() - t0
    got = out["w"].pieces[0][1]
    ok = bool(np.array_equal(got, _array(n)[index]))
    data_read = sum(r.length for k, r in counting.reads if ".json" not in k and "fragment" not in k)
    q.put({"restore_s": seconds, "bytes_read": data_read, "bytes_needed": int(got.nbytes),
           "peak_rss_extra": rss.peak_increase, "bit_exact": ok})


def run_reshard(size: int, parent: str | None = None, cache: str = "auto", rounds: int = 3) -> dict[str, Any]:
    """Save and restore as described in the module docstring; every figure per layout (restore
    time: the median of ``rounds`` cold runs; peak RSS: the largest)."""
    n = int(math.isqrt(size // 4)) // BLOCKS * BLOCKS
    if cache == "auto":
        cache = detect_cache_drop()[0]
    odd = (slice(None), slice(n // BLOCKS * 5 + 37, n // BLOCKS * 6 + 37))
    rows: list[dict[str, Any]] = []
    for layout, tile_bytes in (("tiled", DEFAULT_TILE_BYTES), ("C order", 0)):
        for saved in ("rows", "cols"):
            with tempfile.TemporaryDirectory(prefix="ckptio-reshard-", dir=parent) as root:
                saved_s = in_child(_save, root, n, saved, tile_bytes)["save_s"]
                asks = {"row block": _blocks(n, "rows")[5], "column block": _blocks(n, "cols")[5], "odd column block": odd}
                # Rounds outermost: the disk's speed drifts by more than the differences measured
                # here (two identical C-order reads differed 1.7x), so each round takes every ask once.
                runs: dict[str, list[dict[str, Any]]] = {ask: [] for ask in asks}
                for _ in range(rounds):
                    for ask, index in asks.items():
                        runs[ask].append(in_child(_restore, root, n, index, cache))
                same = statistics.median(r["restore_s"] for r in runs["row block" if saved == "rows" else "column block"])
                for ask, got in runs.items():
                    median = statistics.median(r["restore_s"] for r in got)
                    res = {**got[0], "restore_s": median, "restore_runs_s": [r["restore_s"] for r in got],
                           "vs_same_layout": median / same,
                           "peak_rss_extra": max((r["peak_rss_extra"] or 0) for r in got),
                           "bit_exact": all(r["bit_exact"] for r in got)}
                    rows.append({"layout": layout, "saved": f"{saved[:-1]} blocks", "restored": ask,
                                 "save_s": saved_s, **res})
    rows.append(_n_to_2n(n, parent, cache, rounds))
    return {"array": [n, n], "bytes": n * n * 4, "blocks": BLOCKS, "cache_drop": cache, "rounds": rounds, "rows": rows}


def _n_to_2n(n: int, parent: str | None, cache: str, rounds: int) -> dict[str, Any]:
    """A job twice as large: the array saved as :data:`SMALL_BLOCKS` row blocks (C order, 4 MiB
    checksum blocks), one host restoring half of one of them. Each small shard is checksummed in
    blocks of its own (``ckptio.engine.layout.extent_block``), so this reads about what it needs (a whole
    4 MiB block per half shard before)."""
    count = min(SMALL_BLOCKS, n)
    with tempfile.TemporaryDirectory(prefix="ckptio-reshard-", dir=parent) as root:
        saved_s = in_child(_save_small, root, n, count)["save_s"]
        block = _blocks(n, "rows", count)[5]
        half = (slice(block[0].start, block[0].start + (block[0].stop - block[0].start) // 2), slice(None))
        same = [in_child(_restore, root, n, block, cache) for _ in range(rounds)]
        got = [in_child(_restore, root, n, half, cache) for _ in range(rounds)]
    median = statistics.median(r["restore_s"] for r in got)
    return {"layout": "C order", "saved": f"{count} row blocks", "restored": "half a row block (N -> 2N)",
            "save_s": saved_s, **got[0], "restore_s": median, "restore_runs_s": [r["restore_s"] for r in got],
            "vs_same_layout": median / statistics.median(r["restore_s"] for r in same),
            "peak_rss_extra": max((r["peak_rss_extra"] or 0) for r in got),
            "bit_exact": all(r["bit_exact"] for r in got)}


def render_reshard(res: dict[str, Any]) -> str:
    n = res["array"][0]
    head = (f"reshard: float32[{n}, {n}] ({res['bytes'] / 2**30:.2f} GiB) saved as {res['blocks']} row or column "
            f"blocks; one block restored cold ({res['cache_drop']}), median of {res['rounds']}")
    table = []
    for r in res["rows"]:
        rss = r["peak_rss_extra"]
        same = r.get("vs_same_layout")
        table.append([r["layout"], r["saved"], r["restored"], f"{r['save_s']:.2f}", f"{r['restore_s']:.3f}",
                      "-" if same is None else f"{same:.2f}x", f"{r['bytes_read'] / r['bytes_needed']:.2f}x",
                      f"{r['bytes_needed'] / 2**20:.0f}", "-" if rss is None else f"{rss / 2**20:.0f}",
                      "yes" if r["bit_exact"] else "NO"])
    import io

    out = io.StringIO()
    print_table(head, ["layout", "saved as", "restored", "save s", "restore s", "× same layout", "read/needed",
                       "needed MiB",
                       "peak extra RSS MiB", "bit-exact"], table, out=out)
    summary = reshard_summary(res)
    if summary:
        out.write(summary + "\n")
    return out.getvalue()


def _row(res: dict[str, Any], layout: str, saved: str, restored: str) -> dict[str, Any] | None:
    return next((r for r in res["rows"] if (r["layout"], r["saved"], r["restored"]) == (layout, saved, restored)), None)


def reshard_summary(res: dict[str, Any]) -> str | None:
    """The headline: a column block of row-saved tiled shards, its bytes read per byte needed and
    its time against both same-layout restores (the tiled checkpoint's own row block, and a
    C-order checkpoint's, which reads straight into the destination)."""
    col = _row(res, "tiled", "row blocks", "column block")
    tiled = _row(res, "tiled", "row blocks", "row block")
    plain = _row(res, "C order", "row blocks", "row block")
    if col is None or tiled is None or plain is None:
        return None
    return (f"column block of row-saved tiled shards: read {col['bytes_read'] / col['bytes_needed']:.2f}x what it "
            f"needs, in {col['restore_s'] / tiled['restore_s']:.2f}x the tiled same-layout restore's time and "
            f"{col['restore_s'] / plain['restore_s']:.2f}x the C-order one's")
