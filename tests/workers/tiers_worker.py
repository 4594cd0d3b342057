"""One process of the multi-tier tests (launched by tests/tiers/test_tiers_mp.py); prints one JSON line.

usage: tiers_worker.py MODE ROOT [--steps 1,2,3] [--expect-step N] [--victims 1,2] [--durable URL] ...
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env; PORT2 for the re-formed job of ``emergency``;
TIERS_LOG=1 logs ckptio's INFO lines with timestamps, to follow a run)

Modes:
  save         save --steps to a local-SSD fast tier (ROOT/fast/r<rank>) + the durable tier, wait, exit
  restore      restore (--restore-step, else the newest; expecting --expect-step) with reads of the durable
               tier counted; reports the tiers after it
  emergency    host-RAM fast tier: save, then the --victims die; the others re-form the job on PORT2
               with their replacements and everyone restores
  replacement  a replacement process of ``emergency`` (joins on PORT2, restores)
  copykill     save --steps; the durable tier stalls once --stall-after objects arrived (the test kills us)
  copyresume   a new run on the same fast tiers: the durable copy left unfinished completes
  resume       restore (--restore-step, else the newest; expecting --expect-step), then save --steps of
               generation --gen (other data under the same step numbers), wait, report errors and tiers
  phasekill    save --steps one at a time (each replicated before the next); host --victims kills itself
               (SIGKILL) at replication --phase of the last step (the test then kills the others)
  durabledown  save --steps with every durable write failing; report the lag, exit
  badtarget    restore, host --victims with a target that does not fit the checkpoint (a wrong global shape):
               every host must fail alike, naming that host and why; report the error
  keepup       save --steps back to back while each peer round takes --slow-peer s and the last step's
               round never ends (the node dies mid-replication); after each save, report the newest
               step every host has replicated and the replication lag; exit without closing
               (--no-keep-up: TierPolicy(replica_before_save=False))
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

import ckptio
from ckptio.backends import Backend, open_backend
from ckptio.backends.wrappers import CountingBackend, WrapperBackend
from ckptio.tiers import Retention, TieredCheckpointManager, TierPolicy
from ckptio.tiers.replicator import ReplicationError

ROWS, COLS = 64, 96  # rows per host, per array


def state_for(step: int, rank: int, world: int, arrays: int, gen: int = 0) -> dict:
    """Host ``rank``'s part of the deterministic state of ``step`` (each array row-split across hosts).

    ``gen``: another training run's state at the same step (a re-save after a rollback).
    """
    state: dict = {}
    for name, full in full_arrays(step, world, arrays, gen).items():
        if name == "rep":
            state[name] = full  # replicated: host 0 writes it
            continue
        ix = (slice(rank * ROWS, (rank + 1) * ROWS), slice(None))
        state[name] = ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix])])
    state["step"] = step
    return state


def full_arrays(step: int, world: int, arrays: int, gen: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step + 1_000_003 * gen)
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


def check(out: dict, step: int, rank: int, world: int, arrays: int, gen: int = 0) -> None:
    """Bit-exact against the state saved at ``step`` (by generation ``gen``)."""
    full = full_arrays(step, world, arrays, gen)
    ix = (slice(rank * ROWS, (rank + 1) * ROWS), slice(None))
    assert out["step"] == step, (out["step"], step)
    for name, want in full.items():
        got = out[name] if name == "rep" else out[name].pieces[0][1]
        want = want if name == "rep" else np.ascontiguousarray(want[ix])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, step)


class StallingBackend(WrapperBackend):
    """The first ``after`` writes pass; each later one waits until those are in storage, then touches
    ``marker`` and hangs. So once the marker exists, ``after`` objects have arrived whole (a write is
    a temporary file until its rename: a marker written at the next write's start would not say so)."""

    def __init__(self, inner: Backend, after: int, marker: str) -> None:
        super().__init__(inner)
        self.after = after
        self.marker = marker
        self.writes = 0
        self.arrived = 0
        self._passed = asyncio.Event()
        if after <= 0:
            self._passed.set()

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        if "ckptio.intent." in key:  # a copy's intent and its heartbeats are not objects: they pass
            await self.inner.write(key, buffers)
            return
        self.writes += 1
        if self.writes > self.after:
            await self._passed.wait()
            with open(self.marker, "a") as f:  # noqa: ASYNC230 -- a tiny marker file for the test to see
                f.write(f"{key}\n")
            await asyncio.sleep(3600)
        await self.inner.write(key, buffers)
        self.arrived += 1
        if self.arrived >= self.after:
            self._passed.set()


class FailingBackend(WrapperBackend):
    """Every write fails with a retryable-looking OSError (a durable tier that is down)."""

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        raise OSError(f"injected: durable tier down ({key})")

    async def create_if_absent(self, key: str, data: bytes) -> None:
        raise OSError(f"injected: durable tier down ({key})")


class KillingBackend(WrapperBackend):
    """SIGKILLs this process at the first ``op`` on a key for which ``hit(key)`` is true (a node loss)."""

    def __init__(self, inner: Backend, op: str, hit: object) -> None:
        super().__init__(inner)
        self.op, self.hit = op, hit

    def _maybe_die(self, op: str, key: str) -> None:
        if op == self.op and self.hit(key):  # type: ignore[operator]
            print(f"victim dies at {op} {key}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        self._maybe_die("write", key)
        await self.inner.write(key, buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        self._maybe_die("create", key)
        await self.inner.create_if_absent(key, data)

    async def delete(self, key: str) -> None:
        self._maybe_die("delete", key)
        await self.inner.delete(key)

    async def read_into(self, key: str, rng: object, buffers: Sequence[memoryview]) -> None:
        self._maybe_die("read", key)
        await self.inner.read_into(key, rng, buffers)  # type: ignore[arg-type]


#: Replication phases of the last step N at which ``phasekill`` kills the victim:
#: (store, operation, key predicate). "fast" is the victim's own fast tier, "replica" the replicas it keeps.
def phases(n: int) -> dict[str, tuple[str, str, object]]:
    def under(step: int) -> object:
        return lambda k: k.startswith(f"{step}/")

    return {
        # before replication: host 0 commits the manifest, any other host its part's record's fence
        "commit-own": ("fast", "create", lambda k: k == f"{n}/ckptio.manifest.json"
                       or k.startswith(f"{n}/ckptio.fence.")),
        "send": ("fast", "read", under(n)),  # sending its own objects to its partner
        "receive": ("replica", "write", under(n)),  # receiving its source's objects
        # host 0's replica commits the job's manifest, any other host's its record's fence (ckptio.store.parts)
        "commit-replica": ("replica", "create", lambda k: k == f"{n}/ckptio.manifest.json"
                           or k.startswith(f"{n}/ckptio.fence.")),
        "mark": ("replica", "create", lambda k: k.startswith(f"{n}/ckptio.replica-of.")),
        "prune-replica": ("replica", "delete", under(n - 1)),  # the previous replica goes
        # its own previous step goes (not the retirement of that step's intent, at its own save)
        "retain-own": ("fast", "delete", lambda k: k.startswith(f"{n - 1}/") and "ckptio.intent." not in k),
    }


def manager(args: argparse.Namespace, rank: int, *, durable_backend: Backend | None = None,
            fast: str | None = None, fast_backend: Backend | None = None) -> TieredCheckpointManager:
    policy = TierPolicy(replicate_every=args.every, queue_size=2, fast=Retention(args.keep),
                        retry_backoff_s=0.05, retry_backoff_max_s=0.2)
    durable = args.durable or os.path.join(args.root, "durable")
    return TieredCheckpointManager(
        fast or os.path.join(args.root, "fast", f"r{rank}"), durable, policy=policy,
        durable_backend=durable_backend, fast_backend=fast_backend,
        fast_options=None if (fast or "").startswith("mem://") or fast_backend is not None else
        {"object_size": args.object_size, "fsync": False},
    )


def counted(args: argparse.Namespace) -> CountingBackend:
    return CountingBackend(open_backend(args.durable or os.path.join(args.root, "durable")))


def restore_and_report(mgr: TieredCheckpointManager, args: argparse.Namespace, rank: int, world: int,
                       counter: CountingBackend, **extra: object) -> None:
    t0 = time.perf_counter()
    out = mgr.restore(args.restore_step, target=target_for(rank, world, args.arrays))
    seconds = time.perf_counter() - t0
    rep = mgr.last_restore
    assert rep is not None
    if args.expect_step is not None:
        assert rep.step == args.expect_step, (rep.step, args.expect_step)
    check(out, rep.step, rank, world, args.arrays, args.gen)
    print(json.dumps({
        "rank": rank, "step": rep.step, "sources": {str(k): v for k, v in rep.sources.items()},
        "bytes_from": rep.bytes_from, "durable_reads": counter.calls("read_into"), "seconds": seconds,
        "tiers": mgr.tier_steps(), **extra,
    }), flush=True)


def keep_up(args: argparse.Namespace, rank: int, world: int, steps: Sequence[int]) -> None:
    """The ``keepup`` mode (see the module's docstring); ends the process."""
    import ckptio.tiers.manager as tm

    real = tm.replicate_to_partner

    def slow(group: object, own: object, replica: object, step: int, *a: object, **k: object) -> None:
        time.sleep(3600 if step == steps[-1] else args.slow_peer)  # a loaded network; the last: a dying node
        real(group, own, replica, step, *a, **k)  # type: ignore[arg-type]

    tm.replicate_to_partner = slow  # type: ignore[assignment]
    policy = TierPolicy(replicate_every=0, fast=Retention(args.keep), replica_before_save=args.keep_up)
    mgr = TieredCheckpointManager(os.path.join(args.root, "fast", f"r{rank}"), None, policy=policy,
                                  fast_options={"object_size": args.object_size, "fsync": False})
    seen = []
    for s in steps:
        handle = mgr.save(s, state_for(s, rank, world, args.arrays))
        lag = mgr.replication_lag
        assert lag is not None and handle is not None
        rep = mgr.replicated_steps
        seen.append({"step": s, "replicated": min(rep.values()) if len(rep) == world else None,
                     "uncopied": lag.uncopied})
    handle.result()  # the last step committed in every fast tier; its replication never ends
    print(json.dumps({"rank": rank, "seen": seen, "tiers": mgr.tier_steps()}), flush=True)
    os._exit(0)  # the node dies: no close, no wait for the replica in flight


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
    p.add_argument("--gen", type=int, default=0)
    p.add_argument("--restore-step", type=int)
    p.add_argument("--phase")
    p.add_argument("--slow-peer", type=float, default=0.0)
    p.add_argument("--no-keep-up", dest="keep_up", action="store_false")
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
            mgr.save(s, state_for(s, rank, world, args.arrays, args.gen))
        mgr.wait_until_finished()
        print(json.dumps({"rank": rank, "tiers": mgr.tier_steps()}), flush=True)
        mgr.close()
    elif args.mode == "copyresume":
        mgr = manager(args, rank)
        mgr.wait_until_finished()
        assert mgr.durable_worker is not None
        print(json.dumps({"rank": rank, "tiers": mgr.tier_steps(), "copied": mgr.durable_worker.done}), flush=True)
        mgr.close()
    elif args.mode == "resume":
        counter = counted(args)
        mgr = manager(args, rank, durable_backend=counter)
        out = mgr.restore(args.restore_step, target=target_for(rank, world, args.arrays))
        rep = mgr.last_restore
        assert rep is not None
        if args.expect_step is not None:
            assert rep.step == args.expect_step, (rep.step, args.expect_step)
        check(out, rep.step, rank, world, args.arrays)  # what is restored here is always generation 0
        saved, error = [], None
        try:
            for s in steps:
                if mgr.save(s, state_for(s, rank, world, args.arrays, args.gen)) is not None:
                    saved.append(s)
            mgr.wait_until_finished()
        except Exception as e:  # reported, so that the test shows what went wrong
            error = f"{type(e).__name__}: {e}"
        print(json.dumps({"rank": rank, "step": rep.step, "saved": saved,
                          "error": error, "tiers": mgr.tier_steps()}), flush=True)
        try:
            mgr.close()
        except Exception:
            pass
    elif args.mode == "phasekill":
        where, op, hit = phases(steps[-1])[args.phase]
        victim = rank in victims
        path = os.path.join(args.root, "fast", f"r{rank}")
        fb = open_backend(path, object_size=args.object_size, fsync=False)
        if victim and where == "fast":
            fb = KillingBackend(fb, op, hit)
        mgr = manager(args, rank, fast_backend=fb)
        if victim and where == "replica":
            mgr.replica.backend = mgr.replica.engine.backend = KillingBackend(mgr.replica.backend, op, hit)
        for s in steps:
            mgr.save(s, state_for(s, rank, world, args.arrays))
            mgr.wait_until_finished()  # each step replicated (or failed) before the next: phases are exact
        print(json.dumps({"rank": rank, "tiers": mgr.tier_steps(), "survived": True}), flush=True)
        time.sleep(3600)  # the test kills the whole job once the victim is dead (a job restart)
    elif args.mode == "durabledown":
        mgr = manager(args, rank, durable_backend=FailingBackend(open_backend(
            args.durable or os.path.join(args.root, "durable"))))
        lags = []
        for s in steps:
            mgr.save(s, state_for(s, rank, world, args.arrays)).result()
            lag = mgr.durable_lag
            assert lag is not None
            lags.append([lag.steps, lag.seconds, lag.uncopied])
        error = None
        try:
            mgr.wait_until_finished()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        lag = mgr.durable_lag
        assert lag is not None
        print(json.dumps({"rank": rank, "lags": lags, "owed": lag.owed, "error": error,
                          "tiers": mgr.tier_steps()}), flush=True)
        try:
            mgr.close()
        except ReplicationError:
            pass  # a retry that ran (and failed) after the wait above: reported again, as it should be
    elif args.mode == "keepup":
        keep_up(args, rank, world, steps)
    elif args.mode == "restore":
        counter = counted(args)
        mgr = manager(args, rank, durable_backend=counter)
        restore_and_report(mgr, args, rank, world, counter)
        mgr.close()
    elif args.mode == "badtarget":
        mgr = manager(args, rank)
        target = target_for(rank, world, args.arrays)
        if rank in victims:  # one more row than was saved: the restore's planning refuses it, here only
            w = target["w0"]
            target["w0"] = ckptio.Sharded((w.shape[0] + 1, w.shape[1]), w.dtype, [(ix, None) for ix, _ in w.pieces])
        try:
            mgr.restore(args.restore_step, target=target)
            error = None
        except Exception as e:  # noqa: BLE001 -- reported: the test compares every host's
            error = f"{type(e).__name__}: {e}"
        print(json.dumps({"rank": rank, "error": error}), flush=True)
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
