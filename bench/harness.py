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

from .cases import Case, all_cases
from .spec import Job
from .targets import Target
from .worker import EVENT_PREFIX

__all__ = ["Selection", "run_job", "select_cases"]

Event = dict[str, Any]


class Selection:
    """Which cases run, and why the others do not."""

    def __init__(self) -> None:
        self.run: list[type[Case]] = []
        self.skipped: dict[str, str] = {}


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


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


def run_job(job: Job, target: Target, timeout_s: float,
            on_event: Callable[[Event], None] = lambda e: None) -> dict[str, Any]:
    """Run ``job`` in ``job.world_size`` fresh processes; always returns a result dict."""
    scratch = tempfile.mkdtemp(prefix="ckptio-bench-job-")
    job_path, result_path = os.path.join(scratch, "job.json"), os.path.join(scratch, "result.json")
    with open(job_path, "w") as f:
        json.dump(job.to_json(), f)
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")  # no accelerator probing in a storage benchmark
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(target.worker_env())
    if job.world_size > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(job.world_size))
    procs: list[subprocess.Popen[str]] = []
    logs: list[str] = []
    t0 = time.monotonic()
    timed_out = False
    try:
        for rank in range(job.world_size):
            log = os.path.join(scratch, f"stderr.{rank}")
            logs.append(log)
            with open(log, "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ckptio.bench.worker", job_path, result_path],
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=err, text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    start_new_session=True,
                ))
        q: queue.Queue[Event | None] = queue.Queue()
        assert procs[0].stdout is not None
        threading.Thread(target=_pump, args=(procs[0].stdout, q), daemon=True).start()
        while True:
            left = timeout_s - (time.monotonic() - t0)
            if left <= 0:
                timed_out = True
                break
            try:
                ev = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(p.poll() is not None for p in procs):
                    break
                continue
            if ev is None:
                break
            on_event(ev)
        if not timed_out:
            try:
                for p in procs:
                    p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        _kill(procs)
    result = _read_result(result_path)
    if result is None:
        codes = [p.returncode for p in procs]
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"worker exited with {codes}, no result"
        result = {"case": job.case, "status": "error", "error": why, "samples": [],
                  "stderr_tail": "\n".join(_tail(lg) for lg in logs)[-4000:]}
    elif result.get("status") == "error":
        result["stderr_tail"] = _tail(logs[0], 2000)
    result["wall_s"] = time.monotonic() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None
