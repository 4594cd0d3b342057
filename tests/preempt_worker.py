"""One process of the preemption test (tests/test_preemption.py): a training loop that asks
``reached_preemption`` every step; one process of the job gets SIGTERM.

usage: preempt_worker.py ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)
Writes ``OUT/started-<rank>`` once past step 5, and ``OUT/<rank>.json`` (the step it saved) at the end.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import ckptio


def main() -> int:
    root, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mngr = ckptio.CheckpointManager(root, save_interval_steps=10**6)  # only the preemption step is saved
    x = torch.zeros(4)
    for step in range(1, 100_000):
        dist.all_reduce(x)  # a training step's collective: hosts stay in lockstep
        if step == 5:
            open(os.path.join(out, f"started-{rank}"), "w").close()
        if mngr.reached_preemption(step):
            state = {"w": ckptio.Sharded((world,), np.dtype("i8"), [((slice(rank, rank + 1),), np.array([step]))]),
                     "pos": ckptio.PerHost({"rank": rank, "step": step})}
            assert mngr.save(step, state) is not None, "the preemption step is saved off the interval"
            mngr.wait_until_finished()
            with open(os.path.join(out, f"{rank}.json"), "w") as f:
                json.dump({"step": step}, f)
            mngr.close()
            dist.destroy_process_group()
            return 0
    return 3  # never told


if __name__ == "__main__":
    sys.exit(main())
