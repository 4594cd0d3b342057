"""One process of a multi-process DCP test (launched by tests/dcp/test_dcp_multiprocess.py).

usage: dcp_worker.py MODE ROOT [ARGS]   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)

modes:
  save_dtensor ROOT [stock]   every tensor a DTensor sharded Shard(0) over the world (stock: torch's FileSystemWriter)
  load_shard1 ROOT [torch|once]   load it as Shard(1) over the world (stock torch's reader; ckptio's, read once)
  stock_per_rank ROOT      each rank saves its own state with FileSystemWriter(use_collectives=False), loads it via Reader
  load_full ROOT           load it into plain full tensors
  resume_a ROOT OUT        train N steps, save, train M more; losses -> OUT/a_<rank>.json
  resume_b ROOT OUT        fresh model, restore, train M; losses -> OUT/b_<rank>.json
  async ROOT thread|process   three async_saves while the state keeps changing; check each
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ckptio
from ckptio.dcp import DEFAULT_BUFFERS, Reader, Writer
from ckptio.dcp.stager import HostBuffers

warnings.filterwarnings("ignore")  # DCP warns about no_dist / deprecated paths; not under test here

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int64", "bool", "uint8", "complex64"]
SHAPES = {"rows7": (7, 6), "cols5": (8, 5), "tiny": (3, 4)}  # uneven rows, uneven columns, an empty shard
BLOCK = 64  # small checksum blocks: resharded reads start and end inside blocks


def tensors() -> dict[str, torch.Tensor]:
    """The saved global tensors, the same in every process (bit patterns from a seeded generator)."""
    out = {}
    for dtype in DTYPES:
        if not hasattr(torch, dtype):
            continue
        for label, shape in SHAPES.items():
            if label != "rows7" and dtype not in ("float32", "bfloat16"):
                continue
            name = f"{dtype}_{label}"
            dt = getattr(torch, dtype)
            n = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            if dt == torch.bool:
                raw &= 1
            out[name] = raw.view(dt).reshape(shape)
    # Big enough that each rank's chunk of a stock checkpoint is read by byte ranges (>= 1 MiB records).
    out["big"] = torch.randn(2048, 300, generator=torch.Generator().manual_seed(5))
    return out


def chunk(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's part of ``full`` under Shard(dim) (torch.chunk's split, empty past the end)."""
    parts = list(torch.chunk(full, world, dim))
    return parts[rank].contiguous() if rank < len(parts) else full.narrow(dim, 0, 0).contiguous()


def dtensor(full: torch.Tensor, mesh, dim: int, rank: int, world: int) -> DTensor:
    # Built from local chunks: no collective carries the data (gloo has no float8).
    return DTensor.from_local(chunk(full, dim, rank, world), mesh, [Shard(dim)], run_check=False,
                              shape=full.shape, stride=full.stride())


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)), what


def save_dtensor(root: str, rank: int, world: int, mesh, stock: bool = False) -> None:
    full = tensors()
    sd = {name: dtensor(t, mesh, 0, rank, world) for name, t in full.items()}
    sd["replicated"] = torch.arange(10, dtype=torch.int64)
    sd["meta"] = {"step": 42, "note": "dcp"}
    if stock:  # what a user's existing runs hold: FileSystemWriter's .metadata + per-rank .distcp files
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(root))
        return
    dcp.save(sd, storage_writer=Writer(root, engine_config=ckptio.EngineConfig(block_size=BLOCK)))
    dist.barrier()
    if rank == 0:
        # Each rank wrote its own chunks, and the checkpoint is a native one too.
        from ckptio.engine import run_sync
        from ckptio.store import CheckpointStore

        manifest = run_sync(CheckpointStore(root).read_manifest(""))
        hosts = {s.host for s in manifest.items["float32_rows7"].shards if s.extents}
        assert hosts == set(range(world)), hosts
        assert all(f".h{r:05d}-" in "".join(manifest.objects) for r in range(world)), manifest.objects
        native = ckptio.restore(root)
        for name, t in full.items():
            got = torch.from_numpy(native[name].reshape(-1).view(np.uint8)).view(t.dtype).reshape(t.shape)
            same_bits(got, t, f"native {name}")


def _reader(root: str, how: list[str]):
    """ckptio's Reader (``once``: with read_once), or (``torch``) stock torch's FileSystemReader on a
    checkpoint ckptio wrote."""
    return dcp.FileSystemReader(root) if how == ["torch"] else Reader(root, read_once=how == ["once"])


def load_shard1(root: str, rank: int, world: int, mesh, how: list[str]) -> None:
    full = tensors()
    sd = {name: dtensor(torch.zeros_like(t), mesh, 1, rank, world) for name, t in full.items()}
    sd["replicated"] = torch.zeros(10, dtype=torch.int64)
    sd["meta"] = {"step": 0, "note": ""}
    dcp.load(sd, storage_reader=_reader(root, how))
    for name, t in full.items():
        same_bits(sd[name].to_local(), chunk(t, 1, rank, world), name)
    assert sd["replicated"].equal(torch.arange(10)) and sd["meta"] == {"step": 42, "note": "dcp"}


def load_full(root: str, how: list[str]) -> None:
    full = tensors()
    sd = {name: torch.zeros_like(t) for name, t in full.items()}
    sd["meta"] = {"step": 0, "note": ""}
    dcp.load(sd, storage_reader=_reader(root, how))
    for name, t in full.items():
        same_bits(sd[name], t, name)
    assert sd["meta"] == {"step": 42, "note": "dcp"}
    if how == ["torch"]:  # torch's own converter, on a checkpoint ckptio wrote
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(root, root + ".pt")
        whole = torch.load(root + ".pt", weights_only=False)
        for name, t in full.items():
            same_bits(whole[name], t, f"dcp_to_torch_save {name}")


def refuse_committed_step(root: str, rank: int) -> None:
    """Every rank gets one plain line naming the step and root when it makes a Writer for a committed step."""
    dcp.save({"w": torch.arange(4.0) + rank}, storage_writer=Writer(root, step=1))
    dist.barrier()
    try:
        Writer(root, step=1)
    except FileExistsError as e:
        msg = str(e)
        assert "\n" not in msg and f"step 1 of {root} is already committed" in msg, msg
    else:
        raise AssertionError(f"rank {rank}: a Writer for committed step 1 was made")


def stock_per_rank(root: str, rank: int) -> None:
    """No coordination: every rank writes ``__<rank>.metadata``; DCP then asks the Reader for rank metadata."""
    mine = {"w": torch.arange(6.0) + rank, "meta": {"rank": rank}}
    dcp.save(mine, storage_writer=dcp.FileSystemWriter(root), use_collectives=False)
    dist.barrier()
    assert not os.path.exists(os.path.join(root, ".metadata"))
    out = {"w": torch.zeros(6), "meta": {"rank": -1}}
    dcp.load(out, storage_reader=Reader(root))
    assert out["w"].equal(mine["w"]) and out["meta"] == {"rank": rank}, out


# -- deterministic resume ----------------------------------------------------

N_STEPS, M_STEPS, BATCH, SAMPLES = 6, 6, 8, 48


class Loader:
    """A shuffling data loader whose position is part of the checkpoint."""

    def __init__(self, rank: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.perm = torch.randperm(SAMPLES, generator=self.gen)
        self.pos = 0
        self.epoch = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + BATCH > SAMPLES:
            self.perm, self.pos, self.epoch = torch.randperm(SAMPLES, generator=self.gen), 0, self.epoch + 1
        idx = self.perm[self.pos : self.pos + BATCH]
        self.pos += BATCH
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "perm": self.perm, "pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.gen.set_state(sd["gen"])
        self.perm, self.pos, self.epoch = sd["perm"], sd["pos"], sd["epoch"]


def build(seed: int, rank: int):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                    torch.nn.Linear(16, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(seed * 10 + rank)  # dropout differs per rank: the RNG state is per-rank state
    return model, opt, Loader(rank), get_state_dict


def train(model, opt, loader, steps: int) -> list[str]:
    losses = []
    for _ in range(steps):
        x, y = loader.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())  # exact
    return losses


def state(model, opt, loader, rank: int, step: int, get_state_dict) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd,
            f"rank{rank}": {"rng": torch.get_rng_state(), "loader": loader.state_dict(), "step": step}}


def resume(root: str, out: str, phase: str, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if phase == "a":
        model, opt, loader, get_sd = build(0, rank)
        train(model, opt, loader, N_STEPS)
        dcp.save(state(model, opt, loader, rank, N_STEPS, get_sd), storage_writer=Writer(root, step=N_STEPS))
        losses = train(model, opt, loader, M_STEPS)
    else:
        model, opt, loader, get_sd = build(7, rank)  # other weights, other RNG: all must come back
        sd = state(model, opt, loader, rank, 0, get_sd)
        dcp.load(sd, storage_reader=Reader(root, step=N_STEPS))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        mine = sd[f"rank{rank}"]
        torch.set_rng_state(mine["rng"])
        loader.load_state_dict(mine["loader"])
        assert mine["step"] == N_STEPS
        losses = train(model, opt, loader, M_STEPS)
    with open(os.path.join(out, f"{phase}_{rank}.json"), "w") as f:
        json.dump(losses, f)


# -- async_save --------------------------------------------------------------


def every_buffer_returns(pool: HostBuffers, deadline_s: float = 300.0) -> bool:
    """Wait until every buffer ``pool`` ever allocated is free again; False only if some never come back.

    The deadline bounds a leak, not the timing: a loaded machine may take long, a leak takes forever.
    """
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        gc.collect()
        if pool.free_count() >= pool.allocated:
            return True
        time.sleep(0.05)
    return False


def async_saves(root: str, kind: str, rank: int, world: int, mesh) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    ctype = AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD
    base = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    sd = {"w": dtensor(base.clone(), mesh, 0, rank, world), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    pending = None
    for k in range(3):
        sd["w"].to_local().fill_(k)
        sd["b"].fill_(k)
        sd["step"] = k
        if pending is not None:
            # As with stock DCP: one save in flight (its collectives share the process group).
            pending.result()
        pending = dcp.async_save(sd, storage_writer=Writer(root, step=k), async_checkpointer_type=ctype)
        # Training goes on: the save must hold the staged copy, not these tensors.
        sd["w"].to_local().fill_(-1)
        sd["b"].fill_(-1)
    pending.result()
    # Buffers return to the pool once DCP drops the staged dicts (some time after each save ends,
    # later on a loaded machine); the next staging then copies into them instead of fresh memory.
    # The property: once every buffer is back, a staging allocates none. Waiting for *some* free
    # bytes (as before) raced with the last save's buffers under load: AssertionError (2, 4).
    assert every_buffer_returns(DEFAULT_BUFFERS), (DEFAULT_BUFFERS.allocated, DEFAULT_BUFFERS.reused)
    allocated, reused = DEFAULT_BUFFERS.allocated, DEFAULT_BUFFERS.reused
    Writer(root).stage(sd)
    assert DEFAULT_BUFFERS.reused > reused and DEFAULT_BUFFERS.allocated == allocated, (allocated, reused)
    for k in range(3):
        tgt = {"w": dtensor(torch.zeros(8, 6), mesh, 1, rank, world), "b": torch.zeros(5, dtype=torch.bfloat16),
               "step": -1}
        dcp.load(tgt, storage_reader=Reader(root, step=k))
        assert (tgt["w"].to_local() == k).all() and (tgt["b"] == k).all() and tgt["step"] == k, (kind, k)


def main() -> int:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if mode == "save_dtensor":
        save_dtensor(root, rank, world, mesh, stock=sys.argv[3:] == ["stock"])
    elif mode == "load_shard1":
        load_shard1(root, rank, world, mesh, sys.argv[3:])
    elif mode == "stock_per_rank":
        stock_per_rank(root, rank)
    elif mode == "load_full":
        load_full(root, sys.argv[3:])
    elif mode in ("resume_a", "resume_b"):
        resume(root, sys.argv[3], mode[-1], rank)
    elif mode == "exists":
        refuse_committed_step(root, rank)
    elif mode == "async":
        async_saves(root, sys.argv[3], rank, world, mesh)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # the process-based async executor spawns: keep the guard
    sys.exit(main())
