"""Crash campaign: kill -9 a saving process at random moments, then check what survives.

After each kill, every checkpoint a reader lists must restore bit-exact (no
uncommitted or half-deleted one is ever listed or restored), and the saver
restarted in the same directory must carry on.

    python tests/crash_campaign.py --trials 100 [--root DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

CHILD = r"""
import sys, numpy as np, ckptio
sys.path.insert(0, {here!r})
from crash_campaign import state_for
mngr = ckptio.CheckpointManager({root!r}, max_to_keep=2, keep_period=7)
step = (mngr.latest_step() or 0) + 1
print("ready", flush=True)
while True:
    mngr.save(step, state_for(step))
    step += 1
"""


def state_for(step: int) -> dict:
    """The deterministic state saved at ``step`` (several objects, a few MiB, mixed dtypes)."""
    rng = np.random.default_rng(step)
    return {
        "params": {f"w{i}": rng.standard_normal((256, 257)).astype(np.float32) for i in range(6)},
        "big": rng.integers(0, 255, size=(5 << 20), dtype=np.uint8),
        "step": step,
        "note": f"step {step}",
    }


def check(root: str) -> tuple[int, int | None]:
    """Every listed checkpoint restores bit-exact; returns (how many, newest)."""
    import ckptio

    mngr = ckptio.CheckpointManager(root)
    steps = mngr.all_steps()
    for step in steps:
        got = mngr.restore(step)
        want = state_for(step)
        assert got["step"] == step and got["note"] == want["note"], step
        assert got["big"].tobytes() == want["big"].tobytes(), step
        for k, v in want["params"].items():
            assert got["params"][k].tobytes() == v.tobytes(), (step, k)
    return len(steps), (steps[-1] if steps else None)


def run_campaign(trials: int, root: str, seed: int = 0, max_delay: float = 1.5) -> dict:
    rnd = random.Random(seed)
    here = os.path.dirname(os.path.abspath(__file__))
    code = CHILD.format(here=here, root=root)
    newest_seen: list[int | None] = []
    for _ in range(trials):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != b"ready":
            child.kill()
            raise AssertionError(f"saver did not start: {child.stderr.read().decode()[-2000:] if child.stderr else ''}")
        time.sleep(rnd.uniform(0.0, max_delay))
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        _count, newest = check(root)
        newest_seen.append(newest)
    # Progress was made, and committed steps only ever move forward.
    seen = [s for s in newest_seen if s is not None]
    assert seen and seen == sorted(seen), newest_seen
    import ckptio

    swept = ckptio.CheckpointManager(root).sweep_orphans(grace_seconds=0)
    check(root)
    # Nothing a killed save wrote outlives the sweep: no temporary files of interrupted writes,
    # and no file that the committed checkpoints do not account for.
    from ckptio.backends.local import TMP_MARK

    left = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if TMP_MARK in f]
    assert not left, left
    return {"trials": trials, "newest": seen[-1], "swept": len(swept),
            "temporaries": sum(TMP_MARK in k for k in swept)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--root", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptio-crash-")
    t0 = time.time()
    print(run_campaign(args.trials, root, args.seed), f"{time.time() - t0:.0f}s", root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
