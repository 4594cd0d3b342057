"""How an incremental save tells an unchanged shard (docs/incremental.md): speed, and whether it lets Python run.

The digests, against the byte compare with a held copy (``memcmp``, ckptio.saving.incremental.shadow) and
the staging copy a full save makes of the same bytes (``copy``).

``python -m ckptio.bench.hash_candidates [MiB]``: each candidate over one buffer (best of 3), its
aggregate over two threads at once, and how many iterations a pure-Python thread made per second
while it hashed (a candidate that holds the GIL starves it). Figures depend on load: compare them
within one run.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

from ckptio.saving.incremental.shadow import same_bytes
from ckptio.system.checksum import crc32c


def _rate(fn: Callable[[], object], nbytes: int, n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def _python_rate(fn: Callable[[], object] | None) -> float:
    """Iterations per second (millions) of a pure-Python loop while ``fn`` runs twice (None: idle)."""
    stop, count = [False], [0]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    c0, t0 = count[0], time.perf_counter()
    if fn is None:
        time.sleep(0.3)
    else:
        fn()
        fn()
    elapsed, c1 = time.perf_counter() - t0, count[0]
    stop[0] = True
    th.join()
    return (c1 - c0) / elapsed / 1e6


def main(mib: int = 64) -> None:
    """Print each candidate's figures for a buffer of ``mib`` MiB."""
    arr = np.random.default_rng(0).integers(0, 255, size=mib << 20, dtype=np.uint8)
    held, out = arr.copy(), np.empty_like(arr)
    mv = memoryview(arr)
    nbytes = mib << 20
    candidates: dict[str, Callable[[], object]] = {
        "sha256": lambda: hashlib.sha256(mv).digest(),
        "sha256 (4 MiB chunks)": lambda: [hashlib.sha256(mv[i:i + (4 << 20)]).digest()
                                          for i in range(0, nbytes, 4 << 20)],
        "blake2b": lambda: hashlib.blake2b(mv).digest(),
        "blake2b-32": lambda: hashlib.blake2b(mv, digest_size=32).digest(),
        "crc32c": lambda: crc32c(mv),
        "memcmp (a held copy)": lambda: same_bytes(arr, held),
        "copy (full staging)": lambda: np.copyto(out, arr),
    }
    print(f"Python loop alone: {_python_rate(None):.2f} M it/s; load {os.getloadavg()}")
    for name, fn in candidates.items():
        single = _rate(fn, nbytes)

        def two(fn: Callable[[], object] = fn) -> None:
            ts = [threading.Thread(target=fn) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        both = _rate(two, 2 * nbytes)
        print(f"{name:22s} 1 thread {single:5.2f} GB/s  2 threads {both:5.2f} GB/s  "
              f"Python loop meanwhile {_python_rate(fn):5.2f} M it/s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
