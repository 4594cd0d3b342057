"""One process of a resume test (launched by tests/state/test_perhost.py): real data loaders, per host.

usage: resume_worker.py MODE ROOT OUT N K
  save:    N steps uninterrupted, each host's loaders saved at step K (as leaves of the state) on the way;
  resume:  fresh loaders restored from the newest step (step K), then on to N.
Each rank writes the batches it saw (``OUT/<mode>-<rank>.json``). RANK / WORLD_SIZE / MASTER_* in
the env; one process runs without torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys

import grain
import numpy as np
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptio


def loaders(rank: int) -> dict[str, object]:
    """This host's loaders: each reads its own part of the data, in its own shuffled order."""
    g = torch.Generator()
    g.manual_seed(100 + rank)
    data = list(range(rank * 1000, rank * 1000 + 96))
    torch_loader = StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2, generator=g)
    grain_map = grain.MapDataset.range(rank * 1000, rank * 1000 + 60).shuffle(seed=rank).batch(3)
    grain_iter = grain_map.to_iter_dataset().map(lambda b: b * 2)
    return {"torch": torch_loader, "grain_map": iter(grain_map), "grain_iter": iter(grain_iter)}


def batches(objs: dict[str, object], its: dict[str, object], n: int) -> list[list[list[int]]]:
    """``n`` steps: one batch of every loader each."""
    return [[np.asarray(next(its[k])).tolist() for k in sorted(objs)] for _ in range(n)]


def main() -> int:
    mode, root, out, n, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    objs = loaders(rank)
    seen: list[list[list[int]]] = []
    mngr = ckptio.CheckpointManager(root)
    if mode == "resume":
        # Fresh loaders as the target: restored in place, each host its own.
        got = mngr.restore(target={"loaders": objs, "step": 0})
        assert got["loaders"]["torch"] is objs["torch"]
        start = got["step"]
        # A grain iterator restores into the iterator; the torch loader restarts its iterator where it was.
        its = {"torch": iter(objs["torch"]), "grain_map": objs["grain_map"], "grain_iter": objs["grain_iter"]}
        seen = batches(objs, its, n - start)
    else:
        its = {"torch": iter(objs["torch"]), "grain_map": objs["grain_map"], "grain_iter": objs["grain_iter"]}
        seen = batches(objs, its, k)
        mngr.save(k, {"loaders": objs, "step": k}, force=True)
        seen += batches(objs, its, n - k)  # the save's write overlaps the next steps
        mngr.wait_until_finished()
    mngr.close()
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump(seen, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
