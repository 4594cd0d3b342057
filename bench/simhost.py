"""What every simulated-host bench shares: a child process per simulated host, its own peak RSS,
a store that counts the bytes it reads, the imports a trainer has made anyway."""

from __future__ import annotations

import multiprocessing as mp
import queue
from typing import Any

__all__ = ["counted_store", "in_child", "preload", "rss_mb"]


def rss_mb() -> float:
    """This process's own peak RSS (VmHWM: its memory's, which starts afresh at exec; ``ru_maxrss`` would
    carry the launching process's peak into a spawned child)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def preload() -> None:
    """Import what a training process has imported anyway before it restores: ml_dtypes (jax and
    torch users have it; bfloat16 items need it), whose first import alone costs ~0.5-1.5 s
    here and would otherwise be counted as "load"."""
    import importlib

    importlib.import_module("ml_dtypes")


def counted_store(root: str) -> tuple[Any, list[int]]:
    """A store of ``root`` and a one-element list counting the bytes it reads."""
    from ckptio.store import CheckpointStore

    store = CheckpointStore(root)
    count = [0]
    read_into = store.backend.read_into

    # Counted where every read lands (whole-object reads are a stat + read_into in any wrapper,
    # the store's deadline layer included): planning reads only manifests and fragments.
    async def counting_read_into(key: str, rng: Any, buffers: Any) -> None:
        await read_into(key, rng, buffers)
        count[0] += rng.length

    read_many = store.backend.read_many

    async def counting_read_many(reads: Any) -> None:  # many small reads in one call, counted as one each
        await read_many(reads)
        count[0] += sum(rng.length for _key, rng, _buffers in reads)

    store.backend.read_into = counting_read_into  # type: ignore[method-assign]
    store.backend.read_many = counting_read_many  # type: ignore[method-assign]
    return store, count


def in_child(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:  # a child that dies (an exception, the OOM killer) must not leave us waiting
        try:
            res: dict[str, Any] = q.get(timeout=1)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the {target.__name__} simulation died (exit {p.exitcode}); see its traceback above")
    p.join()
    return res
