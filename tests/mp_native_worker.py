"""One process of a multi-process native save/restore (launched by tests/test_multiprocess.py).

usage: mp_native_worker.py save|restore|incremental ROOT   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)
"""

from __future__ import annotations

import os
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
    if mode == "incremental":  # refused alike on every host: multi-host saves take no references yet
        try:
            ckptio.CheckpointManager(root, incremental=True)
        except ValueError as e:
            assert f"this one has {world} hosts" in str(e), e
        else:
            raise AssertionError("a multi-host CheckpointManager(incremental=True) was not refused")
        dist.barrier()
        assert not os.path.exists(root) or not os.listdir(root), os.listdir(root)
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
