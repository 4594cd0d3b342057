"""One rank of the DCP per-rank loader test (tests/state/test_perhost.py): ``dcp.save`` / ``dcp.load`` of a
StatefulDataLoader wrapped in ``ckptio.dcp.PerRank``, through ckptio's Writer and Reader.

usage: dcp_perrank_worker.py save|resume|resume-one ROOT OUT   (RANK, WORLD_SIZE, MASTER_* in the env)
Each rank writes the two batches after step 3 to ``OUT/<mode>-<rank>.json``. ``resume-one``: one
process loads what two saved (``saved_world=2``, ``take_modulo``: it takes rank 0's).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptio.dcp import Reader, Writer
from ckptio.dcp.perrank import PerRank
from ckptio.state.perhost import take_modulo


def loader(rank: int) -> StatefulDataLoader:
    g = torch.Generator()
    g.manual_seed(10 + rank)
    return StatefulDataLoader(list(range(rank * 100, rank * 100 + 64)), batch_size=4, shuffle=True, num_workers=2,
                              generator=g)


def main() -> int:
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dl = loader(rank)
    wrapped = PerRank(dl, saved_world=2, on_resize=take_modulo) if mode == "resume-one" else PerRank(dl)
    state = {"w": torch.arange(4.0), "loader": wrapped}
    if mode == "save":
        it = iter(dl)
        for _ in range(3):
            next(it)
        dcp.save(state, storage_writer=Writer(root, step=3))
    else:
        dcp.load(state, storage_reader=Reader(root, step=3))
        it = iter(dl)
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump([next(it).tolist() for _ in range(2)], f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
