"""One rank of a 2-process DCP save for the interop tests (gloo; RANK, WORLD_SIZE, MASTER_* in the env).

usage: interop_dcp_worker.py TARGET...

Saves the DTensor state of :data:`interop_data.DCP_TENSORS` (plus values)
to every TARGET: a ckptio URL (local path, ``gs://`` with
STORAGE_EMULATOR_HOST) through ``ckptio.dcp.Writer`` with small checksum
blocks, or ``fs:DIR`` through stock DCP's ``FileSystemWriter``.
"""

from __future__ import annotations

import os
import sys
import warnings

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "support"))  # interop_data
import interop_data as D  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import ckptio  # noqa: E402
from ckptio.dcp import Writer  # noqa: E402

warnings.filterwarnings("ignore")


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def state(rank: int, world: int, mesh: object) -> dict[str, object]:
    sd: dict[str, object] = {}
    for name, arr in D.dcp_arrays().items():
        full = to_torch(arr)
        dim = D.DCP_TENSORS[name][2]
        if dim is None:
            sd[name] = full
            continue
        local = list(torch.chunk(full, world, dim))[rank].contiguous()
        sd[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=full.shape, stride=full.stride()
        )
    sd["meta"] = {"step": 42, "note": "interop"}
    return sd


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    sd = state(rank, world, mesh)
    for target in sys.argv[1:]:
        if target.startswith("fs:"):
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(target[3:]))
        else:
            dcp.save(sd, storage_writer=Writer(target, engine_config=ckptio.EngineConfig(block_size=D.BLOCK)))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
