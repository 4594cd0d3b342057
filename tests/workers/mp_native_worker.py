"""One process of a multi-process native save/restore (launched by tests/api/test_native_multiprocess.py).

usage: mp_native_worker.py save|restore|incremental ROOT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import torch.distributed as dist

import ckptio

SHAPE = (64, 48)


def expected() -> dict[str, np.ndarray]:
    w = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    return {"w": w, "w_bf16": (w / 7).astype(ml_dtypes.bfloat16), "replicated": np.arange(10, dtype=np.int64)}


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = expected()
    if mode == "incremental":  # each process references its own unchanged shard (ckptio.saving.incremental.hosts)
        rows = SHAPE[0] // world
        ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
        frozen = full["w"][ix].copy()
        mngr = ckptio.CheckpointManager(root, incremental=True, max_to_keep=2)
        for step in (1, 2, 3):
            state = {"frozen": ckptio.Sharded(SHAPE, np.float32, [(ix, frozen)]),
                     "moving": ckptio.Sharded(SHAPE, np.float32, [(ix, full["w"][ix] * step)]), "step": step}
            mngr.save(step, state, force=True)
            mngr.wait_until_finished()
        mngr.close()
        dist.barrier()
        out = ckptio.restore(root, step=3)
        assert out["frozen"].tobytes() == full["w"].tobytes() and out["moving"].tobytes() == (full["w"] * 3).tobytes()
        from ckptio.engine import run_sync
        from ckptio.manifest.names import step_of_key

        store = ckptio.CheckpointManager(root).store
        assert run_sync(store.committed_steps()) == [2, 3]
        manifest = run_sync(store.read_manifest("3"))
        assert manifest.bases and "1" in manifest.bases, manifest.bases  # step 1 deleted, its frozen shards held
        assert len([k for k in manifest.objects if step_of_key(k) == "1"]) == world
    elif mode == "save":
        rows = SHAPE[0] // world
        ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
        state = {
            name: ckptio.Sharded(SHAPE, full[name].dtype, [(ix, full[name][ix])]) for name in ("w", "w_bf16")
        }
        state["replicated"] = full["replicated"]
        state["step"] = 11
        ckptio.save(root, state, step=11).result()
        dist.barrier()
        # Each process wrote only its own shard.
        m = ckptio.CheckpointManager(root).store
        from ckptio.engine import run_sync

        manifest = run_sync(m.read_manifest("11"))
        hosts = sorted({s.host for s in manifest.items["w"].shards})
        assert hosts == list(range(world)), hosts
    else:
        cols = SHAPE[1] // world
        ix = (slice(None), slice(rank * cols, (rank + 1) * cols))
        target = {name: ckptio.Sharded(SHAPE, full[name].dtype, [(ix, None)]) for name in ("w", "w_bf16")}
        target["replicated"] = None
        target["step"] = None
        out = ckptio.restore(root, target=target)
        for name in ("w", "w_bf16"):
            got = out[name].pieces[0][1]
            want = np.ascontiguousarray(full[name][ix])
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
        assert out["replicated"].tobytes() == full["replicated"].tobytes()
        assert out["step"] == 11
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
