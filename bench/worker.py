"""One case in one fresh process: ``python -m ckptio.bench.worker JOB.json RESULT.json``.

Why a fresh process per case: peak RSS is only meaningful when no other
library's heap, thread pools or caches are already in the process, and a
case must not inherit another's imports, allocator state or warmed page
cache. Rounds of one case share the process on purpose: a training job
saves again and again from one process, and a library that reuses staging
buffers between saves should get credit for it (the first round shows the
cold cost, the medians the steady state).

Progress goes to stdout as ``@@ckptio-bench {json}`` lines (other output is
ignored by the parent); the result is one JSON file, written by rank 0.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from ckptio.bench import cpu, pinning, train
from ckptio.bench import state as state_mod
from ckptio.bench.cases import Case, CaseContext, get_case
from ckptio.bench.spec import Job
from ckptio.bench.system import PeakRSS, current_rss, drop_cache, equalize_memory, resident_fraction

__all__ = ["EVENT_PREFIX", "main", "run"]

EVENT_PREFIX = "@@ckptio-bench "


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(EVENT_PREFIX + json.dumps(event) + "\n")
    sys.stdout.flush()


def _dir_bytes(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return None
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except OSError:
                pass
    return total


class _Group:
    """Barriers and gathers across the job's processes; no-ops for one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank = int(os.environ.get("RANK", "0")) if world_size > 1 else 0
        if world_size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=self.rank, world_size=world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def _descendants() -> list[dict[str, float]]:
    """This process's descendants that are running now, each as its pid and start time.

    The worker ends with ``os._exit`` (no atexit teardown), so a process a case's library
    started (DCP's checkpoint process, multiprocessing's resource tracker) must end itself
    once the worker is gone. Named here, by pid and start time (a reused pid is another
    process), a caller can check exactly those processes and no other on the machine.
    """
    import psutil

    found: list[dict[str, float]] = []
    for p in psutil.Process().children(recursive=True):
        try:
            found.append({"pid": p.pid, "create_time": p.create_time()})
        except psutil.NoSuchProcess:
            pass  # it ended between the listing and the look: nothing left to outlive us
    return found


def _combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A multi-process round: the checkpoint is done when the slowest rank is; memory and CPU add up."""
    if len(per_rank) == 1:
        return per_rank[0]
    out = dict(per_rank[0])
    for key in ("save_s", "stall_s", "restore_s"):
        if key in out:
            out[key] = max(r[key] for r in per_rank)
    for key in ("save_rss_bytes", "restore_rss_bytes", "save_held_bytes", "restore_sys_s", "restore_user_s",
                "save_cpu_s", "restore_cpu_s"):
        vals = [r.get(key) for r in per_rank]
        out[key] = None if any(v is None for v in vals) else sum(vals)
    out["verified"] = all(r.get("verified", True) for r in per_rank)
    out["ranks"] = per_rank
    return out


def _convert(np_state: dict[str, Any], framework: str) -> dict[str, Any]:
    if framework == "jax":
        return state_mod.to_jax(np_state)
    if framework == "torch":
        return state_mod.to_torch(np_state)
    return np_state


def _one_round(case: Case, job: Job, group: _Group, r: int, expected: dict[str, Any],
               emit: Callable[[dict[str, Any]], None], base_rss: int | None,
               cores: pinning.Cores | None = None) -> dict[str, Any]:
    sample: dict[str, Any] = {"round": r}
    group.barrier()
    os.sync()  # the previous round's writeback must not be billed to this save
    gc.collect()
    group.barrier()
    if job.train:
        sample.update(train.idle(cores=cores))
    emit({"event": "phase", "round": r, "phase": "save"})
    with PeakRSS() as rss:
        cpu0 = cpu.snapshot()
        t0 = time.perf_counter()
        pending = case.save(r)
        t1 = time.perf_counter()
        done: list[float] = []  # the save's end, read as it returns (a --train-window goes on past it)
        if pending is not None:
            if job.train:  # the training thread keeps stepping while the save finishes
                sample.update(train.during(pending.result, cores, job.train_window_s,
                                           on_done=lambda: done.append(time.perf_counter())))
            else:
                pending.result()
        t2 = done[0] if done else time.perf_counter()
        cpu1 = cpu.snapshot()
    # The save's CPU, all threads and processes; the training steps' own CPU is not the save's.
    steps = train.windowed(sample) or sample  # with a --train-window, every step it timed
    steps_cpu = steps.get("train_cpu_s", 0.0) * steps.get("train_steps", 0)
    sample["save_cpu_s"] = max(0.0, cpu.spent(cpu0, cpu1) - steps_cpu)
    now = current_rss()
    # "held": what the process keeps after the save, over its RSS before the first one
    # (a staging pool reused across saves shows here, not in the per-call peak increase).
    sample.update(stall_s=t1 - t0, save_s=t2 - t0, save_rss_bytes=rss.peak_increase, rss_method=rss.method,
                  async_save=pending is not None,
                  save_held_bytes=None if now is None or base_rss is None else max(0, now - base_rss))
    group.barrier()
    if r == 0 and group.rank == 0:
        sample["bytes_on_disk"] = _dir_bytes(case.step_path(0))
    if case.has_restore:
        _restore_round(case, job, group, r, expected, emit, sample)
    return sample


def _restore_round(case: Case, job: Job, group: _Group, r: int, expected: dict[str, Any],
                   emit: Callable[[dict[str, Any]], None], sample: dict[str, Any]) -> None:
    """Round ``r``'s cold restore, timed, checked and recorded into ``sample``."""
    emit({"event": "phase", "round": r, "phase": "drop-cache"})
    path = case.step_path(r)
    if group.rank == 0:
        sample["cache_drop"] = drop_cache(job.cache_drop, path) if path else "n/a"
        sample["resident_before_restore"] = resident_fraction(path) if path else None
    group.barrier()
    gc.collect()
    sample["memory_state"] = "equalized" if job.equalize else "as-is"
    if job.equalize:
        sample.update(equalize_memory(sum(int(v.nbytes) for v in expected.values())))
    emit({"event": "phase", "round": r, "phase": "restore"})
    with PeakRSS() as rss:
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        all0 = cpu.snapshot()
        t0 = time.perf_counter()
        out = case.restore(r)
        t1 = time.perf_counter()
        all1 = cpu.snapshot()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    sample["restore_cpu_s"] = cpu.spent(all0, all1)
    # The process's CPU time in the restore, all threads: on a VM that backs guest memory lazily,
    # first-touching memory the host has not backed (or took back) costs several times the
    # system time of memory it has (see README "Restore system time"), and shows here first.
    sample.update(restore_s=t1 - t0, restore_rss_bytes=rss.peak_increase,
                  restore_sys_s=cpu1.ru_stime - cpu0.ru_stime, restore_user_s=cpu1.ru_utime - cpu0.ru_utime)
    if job.verify:
        emit({"event": "phase", "round": r, "phase": "verify"})
        err = state_mod.verify(out, expected)
        sample["verified"] = err is None
        if err:
            sample["verify_error"] = err
    del out
    gc.collect()


def _my_turn(emit: Callable[[dict[str, Any]], None], r: int) -> bool:
    """Say this gated job is idle and ready for round ``r``, then block until the harness lets it
    run (False: it never will)."""
    emit({"event": "ready", "round": r})
    return bool(sys.stdin.readline())


def run(job: Job, emit: Callable[[dict[str, Any]], None] = _emit) -> dict[str, Any] | None:
    """Run ``job`` in this process; the result dict on rank 0, None on other ranks."""
    result: dict[str, Any] = {"case": job.case, "world_size": job.world_size, "samples": []}
    group: _Group | None = None
    case: Case | None = None
    try:
        cls = get_case(job.case)
        group = _Group(job.world_size)
        t0 = time.perf_counter()
        full = state_mod.generate(job.state)
        result["state_bytes"] = state_mod.state_nbytes(full)
        expected = state_mod.rank_subset(full, group.rank, job.world_size)
        del full
        state = _convert(expected, cls.framework)
        result["generate_s"] = time.perf_counter() - t0
        ctx = CaseContext(
            root=job.root,
            scheme=job.root.split("://", 1)[0] if "://" in job.root else "file",
            spec=job.state,
            rank=group.rank,
            world_size=job.world_size,
            options={"rounds": job.total_rounds, **job.options},
        )
        case = cls(ctx, state)
        t0 = time.perf_counter()
        case.setup()
        result["setup_s"] = time.perf_counter() - t0
        cores = pinning.plan() if job.pin else None
        if cores is not None:  # the case's threads and processes so far onto the rest's cores
            pinning.pin_all(cores)
            result["pinned"] = cores.to_json()
        gc.collect()
        base_rss = current_rss()
        for r in range(job.total_rounds):
            if job.gated and not _my_turn(emit, r):
                raise RuntimeError("the harness stopped this job before its round "
                                   f"{r} (its stdin closed)")
            started = time.time()
            sample = _combine(group.gather(_one_round(case, job, group, r, expected, emit, base_rss, cores)))
            sample["started_at"] = started  # wall clock: shows the order of interleaved rounds
            if r < job.warmup:
                sample["warmup"] = True  # kept, shown apart, out of the medians (report.summarize)
            result["samples"].append(sample)
            emit({"event": "round_done", "round": r})
            if sample.get("verified") is False:
                bad = sample.get("verify_error") or "a rank restored wrong data"
                raise RuntimeError(f"restore verification failed: {bad}")
        result["info"] = case.info()
        result["status"] = "ok"
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        result["status"] = "error"
        result["error"] = f"{type(e).__name__}: {e}".strip()[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
    finally:
        if case is not None:
            try:
                case.close()
            except BaseException as e:  # noqa: BLE001 - a close failure must not hide the result
                result.setdefault("close_error", f"{type(e).__name__}: {e}")
        # After close: what is still running now is what the worker's exit leaves behind.
        result["descendants"] = _descendants()
    return result if group is None or group.rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m ckptio.bench.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        job = Job.from_json(json.load(f))
    result = run(job)
    if result is not None:
        tmp = args[1] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args[1])
    # Skip interpreter teardown: some libraries' atexit hooks (thread pools,
    # process groups) can hang, and the result is already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
