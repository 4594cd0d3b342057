"""One process of a 2-process save or restore in which rank 1's data objects never answer
(launched by tests/backends/test_deadline.py): every rank must fail naming the stuck object, not hang.

usage: stall_worker.py save|restore ROOT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)
Exits 0 when this rank failed as it must, 1 otherwise.
"""

from __future__ import annotations

import sys

import numpy as np
import torch.distributed as dist

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.deadline import Deadlines
from ckptio.backends.stalling import StallingBackend

SHAPE = (8, 64)
CONFIG = ckptio.EngineConfig(retries=1, backoff_initial=0.001, backoff_max=0.01, deadlines=Deadlines(fixed_s=1.0))


def is_data(key: str) -> bool:
    return not key.rsplit("/", 1)[-1].startswith("ckptio.")


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = SHAPE[0] // world
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    full = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
    backend = open_backend(root)
    if rank == 1:
        backend = StallingBackend(backend, is_data, methods=("write",) if mode == "save" else ("read_into",))
    try:
        if mode == "save":
            ckptio.save(root, {"w": ckptio.Sharded(SHAPE, np.float32, [(ix, full[ix])]), "step": 1}, step=1,
                        backend=backend, engine_config=CONFIG).result()
        else:
            with ckptio.CheckpointManager(root, backend=backend, engine_config=CONFIG) as m:
                # Every rank reads its own rows (with read-once, rank 0 alone might read them all).
                target = {"w": ckptio.Sharded(SHAPE, np.float32, [(ix, None)]), "step": None}
                m.restore(target=target, read_once=False)
    except Exception as e:  # noqa: BLE001 - judged here
        message = " | ".join(str(x) for x in (e, e.__cause__, e.__context__) if x is not None)
        what = "writing" if mode == "save" else "reading"
        ok = "did not finish within its deadline" in message and what in message and "host 1" in message or rank == 1
        print(f"rank {rank}: failed as it must: {ok}: {message[:600]}")
        return 0 if ok and "did not finish within its deadline" in message else 1
    print(f"rank {rank}: the {mode} succeeded although rank 1's objects never answer")
    return 1


if __name__ == "__main__":
    sys.exit(main())
