"""Native save from N real processes (torch.distributed, gloo), restored by M with another split."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(__file__), "mp_native_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, *args: str, timeout: float = 120) -> None:
    """Run the worker in ``n`` processes and fail with their output if any fails."""
    port = _free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, WORKER, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    failed = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n\n".join(f"rank {i} exited {rc}:\n{o[-3000:]}" for i, rc, o in failed)


@pytest.mark.slow
@pytest.mark.parametrize("savers", [2, 4])
def test_save_n_restore_1_and_2_with_another_split(tmp_path, savers):
    root = str(tmp_path / "ckpt")
    run_ranks(savers, "save", root)
    run_ranks(1, "restore", root)
    run_ranks(2, "restore", root)
