"""Many hosts saving and restoring at once behind a rate limit (``ckptio bench --fake-gcs --rate-limit R``).

``hosts`` simulated hosts (threads of this process over a thread coordinator,
or with ``--host-processes`` one forked process each, :mod:`ckptio.bench.hostprocs`) each save their rows of one array as one checkpoint, all at once,
then restore them, all at once, through the storage behind a
:class:`~ckptio.bench.ratelimit.RateLimitProxy` that admits ``limit`` requests
a second per class (429 beyond). It reports what failed -- a save, a restore,
and a restore that said "no checkpoint" where there is one -- and, per phase,
the wall time beside the least time the limit allows for the requests it
admitted (their count / ``limit``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.backends.budget import RequestRate
from ckptio.bench.ratelimit import RateLimitProxy
from ckptio.bench.threadhosts import on_hosts

__all__ = ["BODIES", "Phase", "ThrottledRun", "main_rate_limit", "run_throttled", "thread_hosts"]


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
    mode: str = "threads"  # how the hosts ran: "threads" of one process, or "processes"
    #: With host processes: their private memory (USS) summed, the most seen after a phase.
    hosts_uss_bytes: int | None = None

    def report(self) -> str:
        lines = [f"{self.hosts} hosts ({self.mode}), proxy limit {self.limit:g} req/s per class, job budget "
                 f"{'none' if self.budget is None else f'{self.budget:g} req/s per class'}"]
        if self.hosts_uss_bytes is not None:
            lines[0] += f", host processes' private memory {self.hosts_uss_bytes / (1 << 20):.0f} MiB in all"
        for p in self.phases:
            lines.append(f"  {p.name:8s} {p.wall_s:7.2f} s  admitted {p.admitted:5d}  refused (429) {p.refused:5d}  "
                         f"limit allows {p.allowed_s:6.2f} s  ratio {p.ratio:5.2f}  failed {len(p.failures)}  "
                         f"wrong 'no checkpoint' {p.no_checkpoint}")
            lines.extend(f"    {f}" for f in p.failures[:3])
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The run as JSON (``--json``): its settings, and per phase every count and the ratio."""
        doc = dataclasses.asdict(self)
        for p, d in zip(self.phases, doc["phases"]):
            d["ratio"] = p.ratio
        return doc


def _config(budget: float | None, patience_s: float) -> Any:
    from ckptio import EngineConfig

    rate = None if budget is None else RequestRate(reads_per_s=budget, writes_per_s=budget, ramp_period_s=1e9)
    return EngineConfig(request_rate=rate, throttle_patience_s=patience_s)


def _rows(rank: int, rows: int) -> tuple[slice, slice]:
    return slice(rank * rows, (rank + 1) * rows), slice(None)


def _full(hosts: int, rows: int, cols: int) -> np.ndarray:
    return np.arange(hosts * rows * cols, dtype=np.float32).reshape(hosts * rows, cols)


def save_rows(rank: int, coord: Any, *, url: str, rows: int, cols: int, step: int, budget: float | None,
              patience_s: float) -> str | None:
    """One host's part of the job's save: its ``rows`` rows of the array; None, or what failed."""
    import ckptio

    full, mine = _full(coord.size, rows, cols), _rows(rank, rows)
    st = {"w": ckptio.Sharded(full.shape, np.float32, [(mine, full[mine])]), "step": step}
    try:
        ckptio.save(url, st, step=step, coordinator=coord, engine_config=_config(budget, patience_s)).result()
    except Exception as e:  # noqa: BLE001 - counted, every host's
        return f"host {rank}: save: {type(e).__name__}: {e}"
    return None


def restore_rows(rank: int, coord: Any, *, url: str, rows: int, cols: int, step: int, budget: float | None,
                 patience_s: float) -> str | None:
    """One host's part of the job's restore of the newest step; None, or what failed ("no checkpoint: ...")."""
    import ckptio
    from ckptio.errors import CheckpointNotFoundError

    full, mine = _full(coord.size, rows, cols), _rows(rank, rows)
    target = {"w": ckptio.Sharded(full.shape, np.float32, [(mine, None)]), "step": None}
    try:
        with ckptio.CheckpointManager(url, coordinator=coord, engine_config=_config(budget, patience_s)) as m:
            out = m.restore(target=target)
    except CheckpointNotFoundError as e:
        return f"no checkpoint: host {rank}: {e}"
    except Exception as e:  # noqa: BLE001 - counted, every host's
        return f"host {rank}: restore: {type(e).__name__}: {e}"
    if out["step"] != step or not np.array_equal(out["w"].pieces[0][1], full[mine]):
        return f"host {rank}: restore: wrong bytes"
    return None


#: What a host process can run (fixed when the hosts are forked: :class:`~ckptio.bench.hostprocs.HostProcesses`).
BODIES = {"save": save_rows, "restore": restore_rows}

#: Runs a phase on every host: ``(name, kwargs) -> each host's outcome`` (threads or processes).
HostRunner = Callable[[str, dict[str, Any]], list[Any]]


def thread_hosts(hosts: int) -> HostRunner:
    """The hosts as threads of this process (:mod:`ckptio.bench.threadhosts`)."""
    return lambda name, kwargs: on_hosts(hosts, functools.partial(BODIES[name], **kwargs), timeout=900.0)


def run_throttled(url: str, proxy: RateLimitProxy, hosts: int, *, budget: float | None, rows: int = 4,
                  cols: int = 256, step: int = 1, patience_s: float = 600.0,
                  runner: HostRunner | None = None, mode: str = "threads") -> ThrottledRun:
    """Save then restore one ``hosts``-host checkpoint at ``url`` (reached through ``proxy``).

    ``runner``: how the hosts run (default: threads of this process); ``mode`` names it in the report."""
    run = runner or thread_hosts(hosts)
    kwargs = {"url": url, "rows": rows, "cols": cols, "step": step, "budget": budget, "patience_s": patience_s}
    phases = [_phase(name, proxy, run, kwargs) for name in ("save", "restore")]
    return ThrottledRun(hosts, proxy.limit, budget, phases, mode)


def _phase(name: str, proxy: RateLimitProxy, run: HostRunner, kwargs: dict[str, Any]) -> Phase:
    proxy.reset()
    began = time.perf_counter()
    outcomes = run(name, kwargs)
    phase = Phase(name, wall_s=time.perf_counter() - began, admitted=sum(proxy.admitted.values()),
                  refused=sum(proxy.refused.values()), allowed_s=proxy.allowed_span_s())
    for o in outcomes:
        if o is not None:
            phase.failures.append(o)
            phase.no_checkpoint += o.startswith("no checkpoint")
    return phase


#: What a host imports on its first save or restore (with aiohttp): the parent imports it before forking.
_HOST_MODULES = ("ckptio.backends.gcs", "ckptio.manage.manager")


def main_rate_limit(limit: float, hosts: int, budget: str, *, processes: bool = False,
                    json_path: str | None = None) -> int:
    """``ckptio bench --fake-gcs --rate-limit R``: a fresh fake GCS, the proxy, one run; 1 if anything failed.

    ``processes``: each host its own process (forked first, before the server's and the proxy's threads)."""
    import contextlib
    import json

    fraction = None if budget.strip().lower() == "none" else float(budget)
    with contextlib.ExitStack() as stack:
        procs = None
        if processes:
            import importlib

            from ckptio.bench.hostprocs import HostProcesses

            for name in _HOST_MODULES:  # imported once, shared copy-on-write by the forked hosts
                importlib.import_module(name)

            procs = stack.enter_context(HostProcesses(hosts, BODIES))
        run = _serve_and_run(limit, hosts, None if fraction is None else fraction * limit, procs)
    print(run.report())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(run.to_json(), f, indent=1)
    return 1 if any(p.failures for p in run.phases) else 0


def _serve_and_run(limit: float, hosts: int, budget: float | None, procs: Any) -> ThrottledRun:
    """The fake GCS and the proxy in front of it, and one run through them (on ``procs``, else threads)."""
    import os
    import uuid

    from ckptio.bench.fakegcs import FakeGCS

    server = FakeGCS().start()
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    uss: list[int] = []
    try:
        server.create_bucket("ckptio-bench")
        with RateLimitProxy(server.url, limit) as proxy:
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
            env = {"STORAGE_EMULATOR_HOST": proxy.url}

            def on_processes(name: str, kwargs: dict[str, Any]) -> list[Any]:
                out = procs.run(name, kwargs, env)
                uss.append(procs.private_bytes())
                return out  # type: ignore[no-any-return]

            run = run_throttled(f"gs://ckptio-bench/rate-{uuid.uuid4().hex[:8]}", proxy, hosts, budget=budget,
                                runner=None if procs is None else on_processes, mode="processes" if procs is not None else "threads")
    finally:
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        server.stop()
    run.hosts_uss_bytes = max(uss) if uss else None
    return run
