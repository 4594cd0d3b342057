"""The free lists behind every buffer pool (ckptio.system.freelists): a buffer given back is the
next one taken of its key, the bound in bytes holds under threads, and the counts add up."""

from __future__ import annotations

import threading

from ckptio.backends._bounce import BouncePool
from ckptio.system.bufferpool import StagingPool
from ckptio.system.freelists import FreeLists


def test_a_buffer_given_back_is_taken_again_by_its_key_only() -> None:
    pool: FreeLists[tuple[int, bool], bytearray] = FreeLists()
    a = bytearray(8)
    assert pool.take((8, False)) is None and pool.misses == 1
    assert pool.give((8, False), a, 8) and pool.has((8, False)) and not pool.has((8, True))
    assert pool.take((8, True)) is None, "pinned and unpinned buffers of one size are apart"
    assert pool.take((8, False)) is a and pool.hits == 1 and pool.count() == 0 and pool.held_bytes() == 0


def test_the_bound_holds_under_threads_and_every_buffer_is_accounted_for() -> None:
    pool: FreeLists[int, bytearray] = FreeLists(max_bytes=10 * 64)
    kept, dropped = [0], [0]
    lock = threading.Lock()

    def worker() -> None:
        for i in range(400):
            size = 64 if i % 3 else 128
            buf = pool.take(size) or bytearray(size)
            ok = pool.give(size, buf, size)
            with lock:
                kept[0] += ok
                dropped[0] += not ok
            assert pool.held_bytes() <= 10 * 64

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert pool.hits + pool.misses == 8 * 400
    # Every buffer held was given and not taken since: gives kept minus takes that found one.
    assert pool.count() == kept[0] - pool.hits and pool.held_bytes() <= 10 * 64
    pool.clear()
    assert pool.count() == 0 and pool.held_bytes() == 0


def test_the_pools_keep_within_their_bounds() -> None:
    bounce = BouncePool(size=1 << 20, keep=2)
    with bounce.lend() as a, bounce.lend() as b, bounce.lend() as c:
        assert len({id(a), id(b), id(c)}) == 3 and bounce.allocated == 3
    assert bounce.free_bytes() == 2 << 20, "three came back; two are kept"
    with bounce.lend():
        assert bounce.allocated == 3 and bounce.lent == 4
    staging = StagingPool(max_bytes=3 << 20)
    bufs = [staging.take(1 << 20) for _ in range(4)]
    staging.give_back(bufs)
    got, new = staging.obtain(1 << 20)
    assert not new and any(got is b for b in bufs[:3])
