"""Launchers for the interop tests' helper processes (DCP ranks over gloo; the 8-device Orbax worker)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from paths import WORKERS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    # One thread per process: two busy cores are shared with other runs.
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        **(extra or {}),
    }


def run_dcp_ranks(n: int, *targets: str, env: dict[str, str] | None = None, timeout: float = 240) -> None:
    """tests/workers/interop_dcp_worker.py in ``n`` gloo processes; fails with their output if one fails or
    hangs."""
    port = _free_port()
    procs = []
    for rank in range(n):
        e = {
            **_env(env),
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / "interop_dcp_worker.py"), *targets],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        outs = [q.communicate()[0] for q in procs]
        pytest.fail("DCP ranks hung:\n" + "\n\n".join(o[-3000:] for o in outs))
    failed = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n\n".join(f"rank {i} exited {rc}:\n{o[-4000:]}" for i, rc, o in failed)


def run_orbax_worker(
    work: Path, *scenarios: str, env: dict[str, str] | None = None, timeout: float = 300
) -> dict[str, Any]:
    """tests/workers/interop_orbax_worker.py (8 CPU devices) once; its verdict per scenario."""
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "interop_orbax_worker.py"), str(work), *scenarios],
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    path = work / "results.json"
    if not path.exists():
        pytest.fail(f"the Orbax worker died (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}")
    out = json.loads(path.read_text())
    out["__log__"] = (proc.stdout + proc.stderr)[-5000:]
    return out


def check(results: dict[str, Any], name: str) -> None:
    verdict = results.get(name)
    if verdict is None:
        pytest.fail(f"scenario {name} did not run:\n{results['__log__']}")
    assert verdict == "ok", f"scenario {name} failed:\n{verdict}"
