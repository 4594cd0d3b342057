"""Many hosts saving and restoring at once behind a rate limit (``ckptio bench --fake-gcs --rate-limit R``).

``hosts`` simulated hosts (threads of this process, one job over a thread
coordinator) each save their rows of one array as one checkpoint, all at once,
then restore them, all at once, through the storage behind a
:class:`~ckptio.bench.ratelimit.RateLimitProxy` that admits ``limit`` requests
a second per class (429 beyond). It reports what failed -- a save, a restore,
and a restore that said "no checkpoint" where there is one -- and, per phase,
the wall time beside the least time the limit allows for the requests it
admitted (their count / ``limit``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from ckptio.backends.budget import RequestRate

from .ratelimit import RateLimitProxy
from .threadhosts import on_hosts

__all__ = ["Phase", "ThrottledRun", "run_throttled"]


@dataclasses.dataclass
class Phase:
    """One phase (every host saving, or every host restoring) of a throttled run."""

    name: str
    wall_s: float = 0.0
    admitted: int = 0
    refused: int = 0
    allowed_s: float = 0.0  # the least time the limit allows for what was admitted
    failures: list[str] = dataclasses.field(default_factory=list)
    no_checkpoint: int = 0  # restores that said "no checkpoint" although one was committed

    @property
    def ratio(self) -> float:
        """Wall time over the least time the limit allows (1.0: the limit was the only cost)."""
        return self.wall_s / self.allowed_s if self.allowed_s else float("nan")


@dataclasses.dataclass
class ThrottledRun:
    hosts: int
    limit: float
    budget: float | None
    phases: list[Phase]

    def report(self) -> str:
        lines = [f"{self.hosts} hosts, proxy limit {self.limit:g} req/s per class, job budget "
                 f"{'none' if self.budget is None else f'{self.budget:g} req/s per class'}"]
        for p in self.phases:
            lines.append(f"  {p.name:8s} {p.wall_s:7.2f} s  admitted {p.admitted:5d}  refused (429) {p.refused:5d}  "
                         f"limit allows {p.allowed_s:6.2f} s  ratio {p.ratio:5.2f}  failed {len(p.failures)}  "
                         f"wrong 'no checkpoint' {p.no_checkpoint}")
            lines.extend(f"    {f}" for f in p.failures[:3])
        return "\n".join(lines)


def _config(budget: float | None, patience_s: float) -> Any:
    from ckptio import EngineConfig

    rate = None if budget is None else RequestRate(reads_per_s=budget, writes_per_s=budget, ramp_period_s=1e9)
    return EngineConfig(request_rate=rate, throttle_patience_s=patience_s)


def run_throttled(url: str, proxy: RateLimitProxy, hosts: int, *, budget: float | None, rows: int = 4,
                  cols: int = 256, step: int = 1, patience_s: float = 600.0) -> ThrottledRun:
    """Save then restore one ``hosts``-host checkpoint at ``url`` (reached through ``proxy``)."""
    import ckptio
    from ckptio.errors import CheckpointNotFoundError

    shape = (hosts * rows, cols)
    full = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    config = _config(budget, patience_s)

    def mine(rank: int) -> tuple[slice, slice]:
        return slice(rank * rows, (rank + 1) * rows), slice(None)

    def save(rank: int, coord: Any) -> str | None:
        st = {"w": ckptio.Sharded(shape, np.float32, [(mine(rank), full[mine(rank)])]), "step": step}
        try:
            ckptio.save(url, st, step=step, coordinator=coord, engine_config=config).result()
        except Exception as e:  # noqa: BLE001 - counted, every host's
            return f"host {rank}: save: {type(e).__name__}: {e}"
        return None

    def restore(rank: int, coord: Any) -> str | None:
        target = {"w": ckptio.Sharded(shape, np.float32, [(mine(rank), None)]), "step": None}
        try:
            with ckptio.CheckpointManager(url, coordinator=coord, engine_config=config) as m:
                out = m.restore(target=target)
        except CheckpointNotFoundError as e:
            return f"no checkpoint: host {rank}: {e}"
        except Exception as e:  # noqa: BLE001 - counted, every host's
            return f"host {rank}: restore: {type(e).__name__}: {e}"
        if out["step"] != step or not np.array_equal(out["w"].pieces[0][1], full[mine(rank)]):
            return f"host {rank}: restore: wrong bytes"
        return None

    phases = [_phase("save", proxy, hosts, save), _phase("restore", proxy, hosts, restore)]
    return ThrottledRun(hosts, proxy.limit, budget, phases)


def _phase(name: str, proxy: RateLimitProxy, hosts: int, body: Any) -> Phase:
    proxy.reset()
    began = time.perf_counter()
    outcomes = on_hosts(hosts, body, timeout=900.0)
    phase = Phase(name, wall_s=time.perf_counter() - began, admitted=sum(proxy.admitted.values()),
                  refused=sum(proxy.refused.values()), allowed_s=proxy.allowed_span_s())
    for o in outcomes:
        if o is not None:
            phase.failures.append(o)
            phase.no_checkpoint += o.startswith("no checkpoint")
    return phase


def main_rate_limit(limit: float, hosts: int, budget: str) -> int:
    """``ckptio bench --fake-gcs --rate-limit R``: a fresh fake GCS, the proxy, one run; 1 if anything failed."""
    import os
    import uuid

    from .fakegcs import FakeGCS

    fraction = None if budget.strip().lower() == "none" else float(budget)
    server = FakeGCS().start()
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        server.create_bucket("ckptio-bench")
        with RateLimitProxy(server.url, limit) as proxy:
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
            run = run_throttled(f"gs://ckptio-bench/rate-{uuid.uuid4().hex[:8]}", proxy, hosts,
                                budget=None if fraction is None else fraction * limit)
    finally:
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        server.stop()
    print(run.report())
    return 1 if any(p.failures for p in run.phases) else 0
