"""One process of a 2-process save or restore in which one host stops outside storage at a
collective point (launched by tests/coord/test_waits.py): every rank must fail naming the
stopped host and the wait, within the collective deadline, instead of hanging.

usage: collective_wait_worker.py save|pick|outcome|readonce ROOT [torch|jax]
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env; jax: jax.distributed on CPU). Exits 0 when this rank failed as it must.

- save: rank 1 stops before the commit gather of step 2 (after writing its objects);
- pick: rank 0 stops while choosing the step to restore;
- outcome: rank 1 stops while reading, before the restore's outcome gather;
- readonce: rank 1 stops in a round of a read-once (exchange) restore of columns, before it sends.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import ckptio
from ckptio.backends.deadline import Deadlines
from ckptio.coord.waits import CollectiveTimeout
from ckptio.restoring import boxexchange
from ckptio.restoring import step as restore_step
from ckptio.saving.job import SaveJob
from ckptio.store import CheckpointStore

SHAPE = (8, 64)
DEADLINE_S = 4.0
STOP_S = DEADLINE_S + 6.0  # past the others' deadline: they must not wait for it
CONFIG = ckptio.EngineConfig(deadlines=Deadlines(collective_fixed_s=DEADLINE_S))
#: mode -> (the rank that stops, what every rank's error must name)
CASES = {"save": (1, "commit of step 2"), "pick": (0, "choice of the step to restore"),
         "outcome": (1, "every host's outcome"), "readonce": (1, "exchange restore")}


def stop(fn: Any) -> Any:
    """``fn`` after a stop of STOP_S seconds outside storage (a host paused or stuck in Python)."""
    def stopped(*args: Any, **kwargs: Any) -> Any:
        time.sleep(STOP_S)
        return fn(*args, **kwargs)
    return stopped


def astop(fn: Any) -> Any:
    async def stopped(*args: Any, **kwargs: Any) -> Any:
        time.sleep(STOP_S)  # blocks the thread, as a stuck host does: no await to be cancelled at
        return await fn(*args, **kwargs)
    return stopped


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    stopper, what = CASES[mode]
    framework = sys.argv[3] if len(sys.argv) > 3 else "torch"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if framework == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        barrier = dist.barrier
    else:
        import jax

        jax.distributed.initialize(f"127.0.0.1:{os.environ['MASTER_PORT']}", num_processes=world, process_id=rank)
        from jax._src import distributed as jd

        def barrier() -> None:
            jd.global_state.client.wait_at_barrier("collective_wait_worker/start", 120_000)
    rows = SHAPE[0] // world
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    full = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)
    if rank == stopper:
        if mode == "save":
            SaveJob.record = stop(SaveJob.record)  # type: ignore[method-assign]
        elif mode == "pick":
            CheckpointStore.resolve_manifest = astop(CheckpointStore.resolve_manifest)  # type: ignore[method-assign]
        elif mode == "outcome":
            restore_step.restore_checkpoint = stop(restore_step.restore_checkpoint)
        else:
            boxexchange._read_and_pack = stop(boxexchange._read_and_pack)
    barrier()  # the deadline is short: start together, whatever each process's import took
    began = time.monotonic()
    try:
        if mode == "save":
            ckptio.save(root, {"w": ckptio.Sharded(SHAPE, np.float32, [(ix, full[ix])]), "step": 2}, step=2,
                        engine_config=CONFIG).result()
        else:
            with ckptio.CheckpointManager(root, engine_config=CONFIG) as m:
                # read-once: columns of a checkpoint saved whole, so the hosts must exchange (rows
                # of it each host would read for itself)
                cols = SHAPE[1] // world
                mine = (slice(None), slice(rank * cols, (rank + 1) * cols)) if mode == "readonce" else ix
                target = {"w": ckptio.Sharded(SHAPE, np.float32, [(mine, None)]), "step": None}
                m.restore(target=target, read_once=mode == "readonce")
    except Exception as e:  # noqa: BLE001 - judged here
        took = time.monotonic() - began
        chain = [x for x in (e, e.__cause__, e.__context__) if x is not None]
        message = " | ".join(f"{type(x).__name__}: {x}" for x in chain)
        timeout = any(isinstance(x, CollectiveTimeout) for x in chain) or "CollectiveTimeout" in message
        named = f"host {stopper}" in message and what in message
        # The others fail within about two deadlines (a non-coordinator's longest wait); the
        # stopped host once it comes back.
        prompt = took < (STOP_S if rank == stopper else 0) + 2 * DEADLINE_S + 8
        print(f"rank {rank}: failed after {took:.1f}s, timeout={timeout} named={named} prompt={prompt}: "
              f"{message[:800]}", flush=True)
        if rank == 0:  # host 0's process holds the torch store: keep it up until the stopped host is back
            time.sleep(max(0.0, STOP_S + 3 - took))
        return 0 if timeout and named and prompt else 1
    print(f"rank {rank}: the {mode} succeeded although host {stopper} stopped past the deadline")
    return 1


if __name__ == "__main__":
    sys.exit(main())
