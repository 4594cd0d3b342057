"""Parent side: pick cases, run each as a job in fresh worker process(es), collect results.

A case that fails — an exception, a crash, a hang past its timeout, a wrong
restore — becomes a result with ``status: "error"`` and the reason; the run
goes on. Nothing a case does can take the harness down with it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from ckptio.bench.cases import Case, all_cases
from ckptio.bench.spec import Job
from ckptio.bench.targets import Target
from ckptio.bench.worker import EVENT_PREFIX

__all__ = ["QUICK_CASES", "QUICK_SIZE", "Selection", "quick_note", "run_interleaved", "run_job", "select_cases"]

Event = dict[str, Any]


class Selection:
    """Which cases run, and why the others do not."""

    def __init__(self) -> None:
        self.run: list[type[Case]] = []
        self.skipped: dict[str, str] = {}


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


#: The default run (without --full or --cases): the headline comparison alone -- ckptio natively (on
#: numpy, jax and torch state: #35's goals name all three), under Orbax and under DCP, beside the raw
#: disk (buffered, and O_DIRECT: the device's limit, bare and after a snapshot copy + crc32c), stock Orbax, stock DCP and the memcpy floor (the
#: torch stall's reference; no storage, seconds) -- at :data:`QUICK_SIZE`, so that every #35 goal on
#: those shows in each default run. ``--full`` adds the async, torch.save and tensorstore cases and
#: every ratio table (#36: the default must finish in 3 minutes on a loaded 2-core VM).
QUICK_CASES: tuple[str, ...] = (
    "raw-disk", "raw-direct", "raw-direct-snapshot", "memcpy", "orbax-default", "dcp", "ckptio", "ckptio-jax", "ckptio-torch",
    "ckptio-orbax", "ckptio-dcp",
)


#: The quick set's state size (without --size). Its 3 rounds stay: a median needs them.
QUICK_SIZE = "256MiB"


def quick_note() -> str:
    """The line the quick default prints under its goals: what it left out, and how to run it all."""
    return (f"quick set: {len(QUICK_CASES)} cases at {QUICK_SIZE} ({', '.join(QUICK_CASES)}); `ckptio bench "
            "--full` runs every default case at 1 GiB with every ratio table (~12 min on a 2-core VM)")


def select_cases(include: Sequence[str] | None, exclude: Sequence[str], scheme: str) -> Selection:
    """Cases named by ``include`` globs (default: every ``in_default_run`` case), minus ``exclude``."""
    sel = Selection()
    for cls in all_cases():
        if include is None and not cls.in_default_run:
            continue
        if include is not None and not _matches(cls.name, include):
            continue
        if _matches(cls.name, exclude):
            continue
        why = cls.unavailable()
        if why is None and "*" not in cls.schemes and scheme not in cls.schemes:
            why = f"does not run against {scheme}://"
        if why:
            sel.skipped[cls.name] = why
        else:
            sel.run.append(cls)
    return sel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(stream: IO[str], q: queue.Queue[Event | None]) -> None:
    for line in stream:
        if line.startswith(EVENT_PREFIX):
            try:
                q.put(json.loads(line[len(EVENT_PREFIX):]))
            except ValueError:
                pass
    q.put(None)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _kill(procs: Sequence[subprocess.Popen[str]]) -> None:
    # Each worker leads its own session: kill its group (its own helper processes
    # included), by the id we started, and nothing else.
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


class _Running:
    """One job's worker process(es), started; its rank 0's events arrive on ``events``."""

    def __init__(self, job: Job, target: Target) -> None:
        self.job = job
        self.scratch = tempfile.mkdtemp(prefix="ckptio-bench-job-")
        job_path = os.path.join(self.scratch, "job.json")
        self.result_path = os.path.join(self.scratch, "result.json")
        with open(job_path, "w") as f:
            json.dump(job.to_json(), f)
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing in a storage benchmark
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        env.update(target.worker_env())
        if job.world_size > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(job.world_size))
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: list[str] = []
        self.events: queue.Queue[Event | None] = queue.Queue()
        self.ended = False  # rank 0's event stream closed
        self.expired = False  # its deadline passed first
        self.t0 = time.monotonic()
        try:
            for rank in range(job.world_size):
                log = os.path.join(self.scratch, f"stderr.{rank}")
                self.logs.append(log)
                with open(log, "w") as err:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "ckptio.bench.worker", job_path, self.result_path],
                        stdin=subprocess.PIPE if job.gated else subprocess.DEVNULL,
                        stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                        stderr=err, text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        start_new_session=True,
                    ))
        except BaseException:
            _kill(self.procs)
            raise
        assert self.procs[0].stdout is not None
        threading.Thread(target=_pump, args=(self.procs[0].stdout, self.events), daemon=True).start()

    def go(self) -> None:
        """Let every rank of a gated job start its next round."""
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            except (OSError, ValueError):
                pass  # a worker that already exited: its result (or its absence) says why

    def pump(self, deadline: float, on_event: Callable[[Event], None], until: str | None = None) -> None:
        """Pass events on until one is ``until``, the workers end (``ended``) or ``deadline`` passes
        (``expired``)."""
        while not self.ended:
            left = deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                return
            try:
                ev = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(p.poll() is not None for p in self.procs):
                    self.ended = True
                continue
            if ev is None:
                self.ended = True
                break
            on_event(ev)
            if until is not None and ev.get("event") == until:
                return

    def finish(self, deadline: float) -> dict[str, Any]:
        """Wait for the workers (killing what is left at ``deadline``); the job's result dict."""
        timed_out = self.expired
        try:
            for p in self.procs:
                if p.stdin is not None:
                    try:
                        p.stdin.close()  # a gated worker still waiting for its turn ends now
                    except OSError:
                        pass  # it has exited already
            if not timed_out:
                try:
                    for p in self.procs:
                        p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill(self.procs)
        result = _read_result(self.result_path)
        if result is None:
            codes = [p.returncode for p in self.procs]
            why = (f"timed out after {deadline - self.t0:.0f} s" if timed_out
                   else f"worker exited with {codes}, no result")
            result = {"case": self.job.case, "status": "error", "error": why, "samples": [],
                      "stderr_tail": "\n".join(_tail(lg) for lg in self.logs)[-4000:]}
        elif result.get("status") == "error":
            result["stderr_tail"] = _tail(self.logs[0], 2000)
        result["wall_s"] = time.monotonic() - self.t0
        shutil.rmtree(self.scratch, ignore_errors=True)
        return result


def run_job(job: Job, target: Target, timeout_s: float,
            on_event: Callable[[Event], None] = lambda e: None) -> dict[str, Any]:
    """Run ``job`` in ``job.world_size`` fresh processes; always returns a result dict."""
    running = _Running(job, target)
    deadline = running.t0 + timeout_s
    try:
        running.pump(deadline, on_event)
    except BaseException:
        _kill(running.procs)
        raise
    return running.finish(deadline)


def run_interleaved(jobs: Sequence[Job], target: Target, timeouts: Sequence[float],
                    on_events: Sequence[Callable[[Event], None]]) -> list[dict[str, Any]]:
    """Run ``jobs`` side by side, one round at a time: every job's round 0, then every round 1, ...

    Storage speed drifts over minutes (burst credits, neighbours on a shared disk), so
    cases run one after another are compared under different disks. Interleaved, each
    case's round ``r`` runs next to every other case's round ``r``, and a ratio of their
    medians compares them under the same drift. Every job's workers are alive at once
    (their states are all in memory) but only one job works at a time: each is set up
    before any round starts, and a job finishing its last round exits before the next one's
    round begins. The jobs must have ``gated`` set; each gets its own timeout for its whole
    run, as in :func:`run_job`. Always returns one result dict per job, in order.
    """
    if not all(j.gated for j in jobs):
        raise ValueError("run_interleaved needs gated jobs (Job.gated=True)")
    running: list[_Running] = []
    try:
        for job in jobs:
            running.append(_Running(job, target))
        deadlines = [r.t0 + t for r, t in zip(running, timeouts)]
        # No round starts until every job is set up (its state generated: seconds of CPU and
        # memory bandwidth that would otherwise land on the first rounds of the others).
        for r, deadline, on_event in zip(running, deadlines, on_events):
            r.pump(deadline, on_event, until="ready")
        for rnd in range(max((j.total_rounds for j in jobs), default=0)):
            for r, deadline, on_event in zip(running, deadlines, on_events):
                if r.ended or r.expired or rnd >= r.job.total_rounds:
                    continue
                r.go()
                if rnd + 1 < r.job.total_rounds:
                    r.pump(deadline, on_event, until="ready")  # back at its gate: idle again
                else:
                    r.pump(deadline, on_event)  # its last round: let it close and exit first
        return [r.finish(deadline) for r, deadline in zip(running, deadlines)]
    except BaseException:
        for r in running:
            _kill(r.procs)
        raise


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None
