"""One process of the preemption test (tests/coord/test_preemption.py): a training loop that asks
``reached_preemption`` every step; one process of the job gets SIGTERM.

usage: preempt_worker.py torch|jax ROOT OUT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)
``torch``: torch.distributed (gloo), an all-reduce per step keeps the hosts in lockstep; ``jax``:
jax.distributed on CPU (its coordination service's key-value store carries the agreement), hosts
not in lockstep. Writes ``OUT/started-<rank>`` once past step 5, and ``OUT/<rank>.json`` (the step
it saved) at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def main() -> int:
    kind, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if kind == "torch":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        x = torch.zeros(4)

        def train_step() -> None:
            dist.all_reduce(x)  # a training step's collective: hosts stay in lockstep
    else:
        import jax

        jax.distributed.initialize(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", num_processes=world,
                                   process_id=rank)

        def train_step() -> None:
            time.sleep(0.002 * (1 + rank))  # hosts at their own pace

    import ckptio

    mngr = ckptio.CheckpointManager(root, save_interval_steps=10**6)  # only the preemption step is saved
    for step in range(1, 1_000_000):
        train_step()
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
            return 0
    return 3  # never told


if __name__ == "__main__":
    sys.exit(main())
