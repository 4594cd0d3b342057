"""``ckptio bench --incremental FRACTION``: incremental saves against full saves, in one run (issue #37).

A state of ``--size`` bytes in ``--arrays`` float32 arrays; before each of ``--incremental-steps``
steps, the same ``FRACTION`` of the arrays change (one is added to each of their elements, in
place: a frozen base and trained adapters). Two
managers save every step side by side, each in its own directory, ``max_to_keep=3``: one full
(today's saves), one ``incremental=True``, the order alternating per step. Per save: the bytes
written (new data objects), the stall (the ``save`` call: staging, and with ``incremental`` the
byte compares or digests), the save time (until committed, retention included) and the storage
held after it; at the end, the last step's restore time from each (alternating, median of 3).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import ckptio
from ckptio.manifest.names import parse_object

__all__ = ["main_incremental"]


def _objects(root: Path) -> dict[str, int]:
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and parse_object(str(p.relative_to(root))):
            out[str(p.relative_to(root))] = p.stat().st_size
    return out


def _save(mngr: ckptio.CheckpointManager, root: Path, step: int, state: dict[str, Any]) -> dict[str, float]:
    before = _objects(root)
    t0 = time.perf_counter()
    mngr.save(step, state, force=True)
    t1 = time.perf_counter()
    mngr.wait_until_finished()
    t2 = time.perf_counter()
    after = _objects(root)
    return {"written": sum(v for k, v in after.items() if k not in before), "stall": t1 - t0,
            "save": t2 - t0, "held": sum(after.values())}


def main_incremental(fraction: float, size: int, arrays: int, steps: int, parent: str | None = None,
                     keep: bool = False) -> int:
    """Run the bench and print its table; returns the process exit code."""
    if not 0.0 <= fraction <= 1.0:
        print(f"--incremental: FRACTION must lie in [0, 1], got {fraction}")
        return 2
    per = max(1, size // arrays // 4)
    rng = np.random.default_rng(0)
    state: dict[str, Any] = {f"a{i:03d}": rng.standard_normal(per).astype(np.float32) for i in range(arrays)}
    changed = max(0, round(fraction * arrays))
    if abs(changed / arrays - fraction) > 0.005:  # e.g. 0.02 of 32 arrays is 1 array, 3.1 %: say so
        print(f"note: {fraction:g} of {arrays} arrays is {changed} ({changed / arrays:.1%}); "
              f"--arrays {max(100, arrays)} meets it more closely")
    base = Path(tempfile.mkdtemp(prefix="ckptio-incr-", dir=parent))
    roots = {"full": base / "full", "incremental": base / "incremental"}
    mngrs = {name: ckptio.CheckpointManager(root, max_to_keep=3, incremental=name == "incremental")
             for name, root in roots.items()}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    total = per * 4 * arrays
    print(f"incremental bench: {total / 2**20:.0f} MiB in {arrays} arrays, {changed} of them ({fraction:g}) "
          f"changed per step, {steps} steps, max_to_keep=3, in {base}")
    print(f"{'step':>4} {'kind':>12} {'written MiB':>12} {'stall s':>8} {'save s':>8} {'held MiB':>9}")
    try:
        for step in range(1, steps + 1):
            for i in range(changed):  # the same arrays each step (a frozen base, trained adapters)
                state[f"a{i:03d}"] += 1
            order = list(roots) if step % 2 else list(reversed(roots))
            for name in order:
                r = _save(mngrs[name], roots[name], step, state)
                rows[name].append(r)
                print(f"{step:>4} {name:>12} {r['written'] / 2**20:>12.1f} {r['stall']:>8.3f} {r['save']:>8.3f} "
                      f"{r['held'] / 2**20:>9.1f}", flush=True)
        _summary(rows, total)
        _restores(mngrs, steps)
    finally:
        for m in mngrs.values():
            m.close()
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


def _restores(mngrs: dict[str, ckptio.CheckpointManager], step: int, rounds: int = 3) -> None:
    """The last step restored from each manager, alternating, ``rounds`` times: references are
    other keys, read the same way (both steps were just written: the page cache holds both)."""
    times: dict[str, list[float]] = {name: [] for name in mngrs}
    for r in range(rounds):
        for name in (list(mngrs) if r % 2 else list(reversed(mngrs))):
            t0 = time.perf_counter()
            mngrs[name].restore(step)
            times[name].append(time.perf_counter() - t0)
    full, inc = statistics.median(times["full"]), statistics.median(times["incremental"])
    print(f"  restore of step {step} (median of {rounds}): full {full:.3f} s, incremental {inc:.3f} s, "
          f"ratio {inc / full if full else math.nan:6.3f}")


def _summary(rows: dict[str, list[dict[str, float]]], total: int) -> None:
    """Medians over the steps after the first (the first save writes everything either way)."""
    def med(name: str, what: str) -> float:
        return statistics.median(r[what] for r in rows[name][1:]) if len(rows[name]) > 1 else math.nan

    full, inc = "full", "incremental"
    print("medians of steps 2..N (incremental / full):")
    for what, unit in (("written", "MiB"), ("stall", "s"), ("save", "s"), ("held", "MiB")):
        f, i = med(full, what), med(inc, what)
        scale = 2**20 if unit == "MiB" else 1
        print(f"  {what:>8}: full {f / scale:9.3f} {unit}, incremental {i / scale:9.3f} {unit}, "
              f"ratio {i / f if f else math.nan:6.3f}")
    print(f"  written per incremental save: {med(inc, 'written') / total:.1%} of the state; "
          f"storage held: {rows[inc][-1]['held'] / total:.2f}x one full checkpoint "
          f"(full saves: {rows[full][-1]['held'] / total:.2f}x); pid {os.getpid()}")
