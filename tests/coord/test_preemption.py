"""``CheckpointManager.reached_preemption``: every host saves the same step after one host's SIGTERM (issue 34)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from paths import WORKERS

import ckptio

WORKER = str(WORKERS / "preempt_worker.py")


def test_one_host_notice_saves_the_next_step_off_the_interval(tmp_path):
    mngr = ckptio.CheckpointManager(tmp_path, save_interval_steps=1000, preemption_signals=())
    assert [mngr.reached_preemption(s) for s in range(1, 4)] == [False] * 3
    assert not mngr.should_save(4)
    mngr.notify_preemption()
    answers = []
    for s in range(4, 10_000):  # the notice takes effect within the watcher's poll (0.2 s)
        answers.append(mngr.reached_preemption(s))
        if answers[-1]:
            break
        time.sleep(0.01)
    step = 3 + len(answers)
    assert answers[-1] and [mngr.reached_preemption(s) for s in range(step + 1, step + 3)] == [False, False]
    assert mngr.should_save(step) and not mngr.should_save(step + 1)
    mngr.save(step, {"pos": ckptio.PerHost({"at": step})})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [step]
    assert ckptio.restore(tmp_path)["pos"] == {"at": step}
    mngr.close()


def test_sigterm_is_a_notice_once_asked(tmp_path):
    mngr = ckptio.CheckpointManager(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert not mngr.reached_preemption(1)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on
        deadline = time.monotonic() + 30
        step = 2
        while not mngr.reached_preemption(step):
            assert time.monotonic() < deadline, "the SIGTERM was never taken as a notice"
            step += 1
            time.sleep(0.01)
    finally:
        mngr.close()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["torch", "jax"])
def test_sigterm_on_one_of_four_processes_saves_one_step_on_all(tmp_path, kind):
    pytest.importorskip(kind)
    from ckptio.bench.readonce import _free_port

    root, out = str(tmp_path / "ckpt"), tmp_path
    port = _free_port()
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
        procs.append(subprocess.Popen([sys.executable, WORKER, kind, root, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"started-{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not start"
            time.sleep(0.1)
        procs[2].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    steps = {json.loads((out / f"{r}.json").read_text())["step"] for r in range(4)}
    assert len(steps) == 1, steps
    (step,) = steps
    mngr = ckptio.CheckpointManager(root)
    assert mngr.all_steps() == [step]
    got = mngr.restore(target={"w": None, "pos": ckptio.PerHost(None, on_resize=ckptio.state.perhost.take_modulo)})
    assert got["w"].tolist() == [step] * 4
    assert got["pos"].value == {"rank": 0, "step": step}
    mngr.close()
