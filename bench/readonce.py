"""Read-once restore: the storage bytes a whole job reads, with and without ``read_once``.

:func:`run_readonce` saves two checkpoints (a 32 MiB float32 matrix as ``hosts``
row shards; an 8 MiB vector and a small int64 vector, whole), then restores
each in ``hosts`` real processes (torch.distributed, gloo) twice per case --
plain, then ``read_once=True``, then by logical-box exchange
(:mod:`ckptio.restoring.boxexchange`) -- each process reading through a counting
backend wrapper. Cases: ``replicated`` (every process restores the
replicated arrays whole) and ``columns`` (each restores a column block of
the row-sharded matrix). Reported per case and mode: total storage bytes
read by the job over the checkpoint's bytes; the largest peak-RSS growth of a
process over the bytes it restored, *warm* (what the restore itself holds:
each process has made its first collectives before, see :func:`warm_up`) and
*cold* (also counting what that first collective loads: gloo's connections
and library pages, a fixed few MiB that no restore can avoid); and the
slowest process's wall and CPU seconds of its restore.

    python -m ckptio.bench.readonce [HOSTS [cold]]

Each process runs this module as a script (``worker``); tests reuse it
(tests/restoring/test_readonce_mp.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SCENARIOS", "counted_sends", "expected", "launch", "make_checkpoints", "measured", "print_rows",
           "run_readonce", "spawn", "summary", "warm_up", "worker_main"]

ROWS, COLS = 2048, 4096  # float32: 32 MiB
REPLICATED = 2 << 20  # float32 elements: 8 MiB


def expected() -> dict[str, np.ndarray]:
    """The saved arrays (the same in every process: a fixed seed)."""
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
            "emb": rng.standard_normal(REPLICATED, dtype=np.float32),
            "bias": np.arange(1000, dtype=np.int64)}


def make_checkpoints(root: str, shards: int, case: str, steps: tuple[int, ...] = (1,)) -> None:
    """Each step of ``root``: for ``columns``, ``w`` saved as ``shards`` row shards; for
    ``replicated``, ``emb`` and ``bias`` whole (saved from this process)."""
    import ckptio

    full = expected()
    rows = ROWS // shards
    pieces = [((slice(i * rows, (i + 1) * rows), slice(None)), full["w"][i * rows:(i + 1) * rows])
              for i in range(shards)]
    state = ({"w": ckptio.Sharded((ROWS, COLS), np.float32, pieces)} if case == "columns"
             else {"emb": full["emb"], "bias": full["bias"]})
    for step in steps:
        ckptio.save(root, state, step=step).result()


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def _reset_peak() -> int:
    """Reset this process's peak RSS to its current RSS (Linux ``clear_refs`` 5); the RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kib("VmRSS")


#: Set by :func:`warm_up`: what it added to peak RSS (KiB), for the first :func:`measured` call's cold figure.
_COLD: dict[str, int] = {}


def warm_up(default_group: bool = False) -> None:
    """This process's first collectives, before anything is measured: the coordinator ckptio
    restores over (for torch its own gloo group: connections to every peer) and, with
    ``default_group``, torch's default process group (what DCP plans over) each used once, so that
    the first restore's peak RSS is the restore's, not the loading of gloo's pages. Collective.
    What they add to peak RSS is kept for the first :func:`measured` call's cold figure (ckptio is
    imported before the baseline: a scenario imports it before it measures)."""
    import importlib

    importlib.import_module("ckptio")
    from ckptio.coord.distributed import default_coordinator

    base = _reset_peak()
    coord: Any = default_coordinator()
    if coord.size > 1:
        coord.broadcast(coord.gather(coord.all_gather(coord.rank)))
        if callable(getattr(coord, "exchange_into", None)):
            peers = range(coord.size)
            coord.exchange_into({r: [memoryview(bytearray(8))] for r in peers}, {r: [8] for r in peers},
                                {r: [memoryview(bytearray(8))] for r in peers})
    torch = sys.modules.get("torch")
    if default_group and torch is not None and torch.distributed.is_initialized():
        dist, size = torch.distributed, torch.distributed.get_world_size()
        dist.all_gather_object([None] * size, dist.get_rank())
        dist.broadcast_object_list([0])
        dist.scatter_object_list([None], list(range(size)) if dist.get_rank() == 0 else None)
        dist.barrier()
    _COLD["growth"] = max(0, _kib("VmHWM") - base)


def measured(run: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """``run()``, and what it cost this process: peak RSS growth (bytes, from its start: warm);
    cold, that plus what :func:`warm_up` added if this is the first call since (what a fresh
    process's first restore pays on top; compare with runs that do not warm up,
    ``python -m ckptio.bench.readonce 8 cold``); wall and CPU seconds."""
    base = _reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    out = run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    growth = max(0, _kib("VmHWM") - base)
    return out, {"rss_growth": growth * 1024, "rss_cold": (growth + _COLD.pop("growth", 0)) * 1024,
                 "wall_s": round(wall, 4), "cpu_s": round(cpu, 4)}


def restore_counted(root: str, step: int | None, target: Any, read_once: bool | str) -> tuple[Any, dict[str, Any]]:
    """``ckptio.restore`` through a counting backend: the tree, storage bytes read, and
    :func:`measured`'s figures. ``read_once="exchange"``: by logical-box exchange
    (:mod:`ckptio.restoring.boxexchange`)."""
    import ckptio
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    counting = CountingBackend(open_backend(root))
    with counted_sends() as sent:
        out, stats = measured(lambda: ckptio.restore(root, step, target, backend=counting, read_once=read_once))
    return out, {"read": counting.bytes_read, "sent": sent[0], **stats}


@contextlib.contextmanager
def counted_sends() -> Iterator[list[int]]:
    """The bytes this process sends other processes in exchanges of ckptio's default coordinator
    meanwhile (``[n]``, filled on exit; 0 where it has no exchange)."""
    from ckptio.coord.distributed import default_coordinator

    coord: Any = default_coordinator()
    sent = [0]
    wrapped = {}
    for name in ("exchange", "exchange_into"):
        real = getattr(coord, name, None)
        if callable(real):
            def counting(sends: dict[int, list[memoryview]], *a: Any, _real: Any = real, **kw: Any) -> Any:
                sent[0] += sum(b.nbytes for dst, bufs in sends.items() if dst != coord.rank for b in bufs)
                return _real(sends, *a, **kw)

            wrapped[name] = counting
    try:
        for name, fn in wrapped.items():
            setattr(coord, name, fn)
        yield sent
    finally:
        for name in wrapped:
            delattr(coord, name)


def replicated(root: str, read_once: bool | str) -> dict[str, Any]:
    """Every process restores the replicated arrays whole (checked bit-exact)."""
    full = expected()
    out, stats = restore_counted(root, 1, {"emb": None, "bias": None}, read_once)
    for name in ("emb", "bias"):
        assert out[name].tobytes() == full[name].tobytes(), name
    return {**stats, "restored": full["emb"].nbytes + full["bias"].nbytes}


def columns(root: str, read_once: bool | str) -> dict[str, Any]:
    """Each process restores its column block of the row-sharded matrix (checked bit-exact)."""
    import ckptio

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    full = expected()["w"]
    cols = COLS // world
    ix = (slice(None), slice(rank * cols, (rank + 1) * cols))
    out, stats = restore_counted(root, 1, {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)])}, read_once)
    got = out["w"].pieces[0][1]
    assert got.tobytes() == np.ascontiguousarray(full[ix]).tobytes()
    return {**stats, "restored": got.nbytes}


SCENARIOS: dict[str, Callable[[str, Any], dict[str, Any]]] = {"replicated": replicated, "columns": columns}


def worker_main(argv: list[str], scenarios: dict[str, Callable[[str, Any], dict[str, Any]]],
                default_group: bool = False) -> int:
    """One process: ``OUT_DIR SCENARIO ROOT [plain|exchange] [jax] [cold]``, writes
    ``OUT_DIR/<rank>.json``. ``jax``: the job is jax.distributed (CPU), not torch.distributed.
    The process makes its first collectives (:func:`warm_up`, ``default_group`` too where the
    scenarios use it) before the scenario, unless ``cold``."""
    out_dir, scenario, root = argv[:3]
    if "jax" in argv[3:]:
        import jax

        rank = int(os.environ["RANK"])
        jax.distributed.initialize(f"127.0.0.1:{os.environ['MASTER_PORT']}", int(os.environ["WORLD_SIZE"]), rank)
        from jax._src import distributed

        def barrier() -> None:
            distributed.global_state.client.wait_at_barrier("readonce-bench-end", 300_000)

        shutdown = jax.distributed.shutdown
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, barrier, shutdown = dist.get_rank(), dist.barrier, dist.destroy_process_group
    if "cold" not in argv[3:]:
        warm_up(default_group)
    result = scenarios[scenario](root, "exchange" if "exchange" in argv[3:] else "plain" not in argv[3:])
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    barrier()
    shutdown()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(script: str, n: int, args: list[str], timeout: float = 300) -> None:
    """Run ``python script *args`` as the ``n`` ranks of a torch.distributed job on this machine;
    AssertionError with their output if any fails (all are killed if one hangs past ``timeout``)."""
    port = _free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    failed = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n\n".join(f"rank {i} exited {rc}:\n{o[-3000:]}" for i, rc, o in failed)


def launch(script: str, n: int, args: list[str], out: Path, timeout: float = 300) -> list[dict[str, Any]]:
    """:func:`spawn` a worker (``script OUT_DIR *args``); each rank's report, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    spawn(script, n, [str(out), *args], timeout)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(n)]


def stored_bytes(root: str, step: str = "1") -> int:
    """The checkpoint's bytes: every object of the step."""
    return sum(p.stat().st_size for p in Path(root, step).iterdir())


def run_readonce(hosts: int = 8, root: str | None = None, cold: bool = False) -> list[dict[str, Any]]:
    """Per case and mode: job storage bytes read, that over the checkpoint's bytes, worst RSS growth
    (``cold``: no process warms up first; the warm column is then the cold figure too)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for case in SCENARIOS:
            ckpt = os.path.join(tmp, case)
            make_checkpoints(ckpt, hosts, case)
            stored = stored_bytes(ckpt)
            for mode in ("plain", "read_once", "exchange"):
                reports = launch(__file__, hosts, [case, ckpt] + ([mode] if mode != "read_once" else [])
                                 + (["cold"] if cold else []), Path(tmp, f"{case}-{mode}"))
                rows.append(summary(case, mode, stored, reports))
    return rows


def summary(case: str, mode: str, stored: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of a read-once bench: the job's storage bytes read (and over ``stored``), the worst
    rank's peak RSS growth (MiB, and over the bytes it restored; warm and cold, see
    :func:`measured`), the slowest rank's wall and CPU seconds."""
    total = sum(r["read"] for r in reports)
    cold = [r.get("rss_cold", r["rss_growth"]) for r in reports]
    return {"case": case, "mode": mode, "hosts": len(reports), "stored": stored, "job_read": total,
            "read_over_stored": round(total / stored, 3),
            "max_sent": max(r.get("sent", 0) for r in reports),
            "max_rss_growth_mib": round(max(r["rss_growth"] for r in reports) / 2**20, 1),
            "max_rss_over_restored": round(max(r["rss_growth"] / r["restored"] for r in reports), 2),
            "max_cold_rss_over_restored": round(max(c / r["restored"] for c, r in zip(cold, reports)), 2),
            "max_wall_s": max(r.get("wall_s", 0.0) for r in reports),
            "max_cpu_s": max(r.get("cpu_s", 0.0) for r in reports)}


def print_rows(rows: list[dict[str, Any]]) -> None:
    """The rows of :func:`summary`, as a table."""
    print(f"{'case':<15} {'mode':<10} {'hosts':>5} {'stored MiB':>10} {'job read MiB':>12} {'read/stored':>11} "
          f"{'peak RSS growth MiB':>19} {'peak RSS/restored':>17} {'cold':>5} {'wall s':>6} {'CPU s':>6} "
          f"{'max sent MiB':>12}")
    for r in rows:
        print(f"{r['case']:<15} {r['mode']:<10} {r['hosts']:>5} {r['stored'] / 2**20:>10.1f} "
              f"{r['job_read'] / 2**20:>12.1f} {r['read_over_stored']:>11} {r['max_rss_growth_mib']:>19} "
              f"{r['max_rss_over_restored']:>17} {r['max_cold_rss_over_restored']:>5} {r['max_wall_s']:>6.2f} "
              f"{r['max_cpu_s']:>6.2f} {r['max_sent'] / 2**20:>12.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 3:  # a process of a job (OUT_DIR SCENARIO ROOT ...)
        sys.exit(worker_main(sys.argv[1:], SCENARIOS))
    print_rows(run_readonce(int(sys.argv[1]) if len(sys.argv) > 1 else 8, cold="cold" in sys.argv[2:]))
