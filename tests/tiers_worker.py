"""One process of the multi-tier tests (launched by tests/test_tiers_mp.py); prints one JSON line.

usage: tiers_worker.py MODE ROOT [--steps 1,2,3] [--expect-step N] [--victims 1,2] [--durable URL] ...
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env; PORT2 for the re-formed job of ``emergency``;
TIERS_LOG=1 logs ckptio's INFO lines with timestamps, to follow a run)

Modes:
  save         save --steps to a local-SSD fast tier (ROOT/fast/r<rank>) + the durable tier, wait, exit
  restore      restore (expecting --expect-step) with reads of the durable tier counted
  emergency    host-RAM fast tier: save, then the --victims die; the others re-form the job on PORT2
               with their replacements and everyone restores
  replacement  a replacement process of ``emergency`` (joins on PORT2, restores)
  copykill     save --steps; the durable tier stalls after --stall-after object writes (the test kills us)
  copyresume   a new run on the same fast tiers: the durable copy left unfinished completes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence

import ml_dtypes
import numpy as np
import torch.distributed as dist
from ckptio.backends import Backend, open_backend
from ckptio.backends.wrappers import CountingBackend, WrapperBackend

import ckptio
from ckptio.tiers import Retention, TieredCheckpointManager, TierPolicy

ROWS, COLS = 64, 96  # rows per host, per array


def state_for(step: int, rank: int, world: int, arrays: int) -> dict:
    """Host ``rank``'s part of the deterministic state of ``step`` (each array row-split across hosts)."""
    state: dict = {}
    for name, full in full_arrays(step, world, arrays).items():
        if name == "rep":
            state[name] = full  # replicated: host 0 writes it
            continue
        ix = (slice(rank * ROWS, (rank + 1) * ROWS), slice(None))
        state[name] = ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix])])
    state["step"] = step
    return state


def full_arrays(step: int, world: int, arrays: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    out: dict[str, np.ndarray] = {}
    for i in range(arrays):
        out[f"w{i}"] = rng.standard_normal((world * ROWS, COLS)).astype(np.float32)
    out["b"] = rng.standard_normal((world * ROWS, COLS)).astype(ml_dtypes.bfloat16)
    out["rep"] = rng.integers(0, 1 << 40, size=257, dtype=np.int64)
    return out


def target_for(rank: int, world: int, arrays: int) -> dict:
    ix = (slice(rank * ROWS, (rank + 1) * ROWS), slice(None))
    full = full_arrays(0, world, arrays)
    t: dict = {n: ckptio.Sharded(a.shape, a.dtype, [(ix, None)]) for n, a in full.items() if n != "rep"}
    t["rep"] = None
    t["step"] = None
    return t


def check(out: dict, step: int, rank: int, world: int, arrays: int) -> None:
    """Bit-exact against the state saved at ``step``."""
    full = full_arrays(step, world, arrays)
    ix = (slice(rank * ROWS, (rank + 1) * ROWS), slice(None))
    assert out["step"] == step, (out["step"], step)
    for name, want in full.items():
        got = out[name] if name == "rep" else out[name].pieces[0][1]
        want = want if name == "rep" else np.ascontiguousarray(want[ix])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, step)


class StallingBackend(WrapperBackend):
    """Writes pass until ``after`` of them went through; then each write touches ``marker`` and hangs."""

    def __init__(self, inner: Backend, after: int, marker: str) -> None:
        super().__init__(inner)
        self.after = after
        self.marker = marker
        self.writes = 0

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        self.writes += 1
        if self.writes > self.after:
            with open(self.marker, "a") as f:  # noqa: ASYNC230 -- a tiny marker file for the test to see
                f.write(f"{key}\n")
            await asyncio.sleep(3600)
        await self.inner.write(key, buffers)


def manager(args: argparse.Namespace, rank: int, *, durable_backend: Backend | None = None,
            fast: str | None = None) -> TieredCheckpointManager:
    policy = TierPolicy(replicate_every=args.every, queue_size=2, fast=Retention(args.keep))
    durable = args.durable or os.path.join(args.root, "durable")
    return TieredCheckpointManager(
        fast or os.path.join(args.root, "fast", f"r{rank}"), durable, policy=policy,
        durable_backend=durable_backend, fast_options=None if (fast or "").startswith("mem://") else
        {"object_size": args.object_size, "fsync": False},
    )


def counted(args: argparse.Namespace) -> CountingBackend:
    return CountingBackend(open_backend(args.durable or os.path.join(args.root, "durable")))


def restore_and_report(mgr: TieredCheckpointManager, args: argparse.Namespace, rank: int, world: int,
                       counter: CountingBackend, **extra: object) -> None:
    t0 = time.perf_counter()
    out = mgr.restore(target=target_for(rank, world, args.arrays))
    seconds = time.perf_counter() - t0
    rep = mgr.last_restore
    assert rep is not None
    if args.expect_step is not None:
        assert rep.step == args.expect_step, (rep.step, args.expect_step)
    check(out, rep.step, rank, world, args.arrays)
    print(json.dumps({
        "rank": rank, "step": rep.step, "sources": {str(k): v for k, v in rep.sources.items()},
        "bytes_from": rep.bytes_from, "durable_reads": counter.calls("read_into"), "seconds": seconds, **extra,
    }), flush=True)


def main() -> int:
    if os.environ.get("TIERS_LOG"):
        import logging
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)6d %(threadName)s %(name)s %(message)s")
    p = argparse.ArgumentParser()
    p.add_argument("mode")
    p.add_argument("root")
    p.add_argument("--steps", default="1,2,3,4,5")
    p.add_argument("--expect-step", type=int)
    p.add_argument("--victims", default="1")
    p.add_argument("--durable")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--arrays", type=int, default=2)
    p.add_argument("--object-size", type=int, default=64 << 20)
    p.add_argument("--stall-after", type=int, default=1)
    args = p.parse_args()
    steps = [int(s) for s in args.steps.split(",") if s]
    victims = {int(v) for v in args.victims.split(",") if v}
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if args.mode == "replacement":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT2']}",
                                rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")

    if args.mode in ("save", "copykill"):
        backend = None
        if args.mode == "copykill":
            backend = StallingBackend(open_backend(args.durable or os.path.join(args.root, "durable")),
                                      args.stall_after, os.path.join(args.root, f"stalled.r{rank}"))
        mgr = manager(args, rank, durable_backend=backend)
        for s in steps:
            mgr.save(s, state_for(s, rank, world, args.arrays))
        mgr.wait_until_finished()
        print(json.dumps({"rank": rank, "tiers": mgr.tier_steps()}), flush=True)
        mgr.close()
    elif args.mode == "copyresume":
        mgr = manager(args, rank)
        mgr.wait_until_finished()
        assert mgr.durable_worker is not None
        print(json.dumps({"rank": rank, "tiers": mgr.tier_steps(), "copied": mgr.durable_worker.done}), flush=True)
        mgr.close()
    elif args.mode == "restore":
        counter = counted(args)
        mgr = manager(args, rank, durable_backend=counter)
        restore_and_report(mgr, args, rank, world, counter)
        mgr.close()
    elif args.mode == "emergency":
        mgr = manager(args, rank, fast=f"mem://tiers-fast-r{rank}")
        for s in steps:
            mgr.save(s, state_for(s, rank, world, args.arrays))
        mgr.close()  # everything replicated (peer and durable)
        dist.barrier()
        if rank in victims:  # node loss: its RAM (fast tier and the replica it kept) is gone
            os.kill(os.getpid(), signal.SIGKILL)
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT2']}",
                                rank=rank, world_size=world)
        counter = counted(args)
        mgr = manager(args, rank, durable_backend=counter, fast=f"mem://tiers-fast-r{rank}")
        restore_and_report(mgr, args, rank, world, counter, survivor=True)
        mgr.close()
    elif args.mode == "replacement":
        counter = counted(args)
        mgr = manager(args, rank, durable_backend=counter, fast=f"mem://tiers-fast-r{rank}")
        restore_and_report(mgr, args, rank, world, counter, survivor=False)
        mgr.close()
    else:
        raise SystemExit(f"unknown mode {args.mode!r}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
