"""The process-wide shelf of idle worker pools: a closed store's threads serve the next store."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptio.system import poolshelf
from ckptio.system.poolshelf import KEEP, give_pool, parked, take_pool


@pytest.fixture(autouse=True)
def empty_shelf() -> Iterator[None]:
    """Each test starts and ends with nothing parked (pools other tests parked are shut down)."""

    def clear() -> None:
        with poolshelf._lock:
            pools = [p for v in poolshelf._shelf.values() for p in v]
            poolshelf._shelf.clear()
        for p in pools:
            p.shutdown(wait=False)

    clear()
    yield
    clear()


def _threads_started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    start = threading.Thread.start

    def counting(self: threading.Thread, *a: Any, **k: Any) -> None:
        count[0] += 1
        start(self, *a, **k)

    monkeypatch.setattr(threading.Thread, "start", counting)
    return count


def test_a_given_back_pool_is_the_next_one_taken_of_its_kind_with_its_threads_running() -> None:
    pool = take_pool("t-shelf", 3, started=True)
    threads = set(pool._threads)
    assert len(threads) == 3
    give_pool(pool)
    assert parked("t-shelf") == 1
    again = take_pool("t-shelf", 3)
    assert again is pool and set(again._threads) == threads
    assert again.submit(lambda: 7).result(5) == 7
    give_pool(again)


def test_kinds_are_kept_apart() -> None:
    pool = take_pool("t-kind", 2)
    give_pool(pool)
    for other in (take_pool("t-kind", 3), take_pool("t-kind", 2, nice=1), take_pool("t-other", 2)):
        assert other is not pool
        other.shutdown(wait=False)
    assert take_pool("t-kind", 2) is pool
    pool.shutdown(wait=False)


def test_a_pool_given_back_twice_is_parked_once_so_two_owners_never_share_it() -> None:
    pool = take_pool("t-twice", 1)
    give_pool(pool)
    give_pool(pool)
    assert parked("t-twice") == 1
    first, second = take_pool("t-twice", 1), take_pool("t-twice", 1)
    assert first is pool and second is not pool
    for p in (first, second):
        p.shutdown(wait=False)


def test_at_most_keep_are_parked_and_the_rest_are_shut_down() -> None:
    pools = [take_pool("t-keep", 1) for _ in range(KEEP + 2)]
    for p in pools:
        give_pool(p)
    assert parked("t-keep") == KEEP
    assert [p._shutdown for p in pools] == [False] * KEEP + [True] * 2


def test_a_pool_not_made_here_is_shut_down_not_parked() -> None:
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    give_pool(pool)
    give_pool(None)
    assert pool._shutdown and parked() == 0


def _child_takes_a_pool(out: Any) -> None:
    pool = take_pool("t-fork", 2)
    out.put((parked("t-fork"), pool.submit(os.getpid).result(10)))


def test_a_forked_child_starts_with_an_empty_shelf_and_its_pools_work() -> None:
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    give_pool(take_pool("t-fork", 2, started=True))
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_takes_a_pool, args=(out,))
    child.start()
    try:
        n, pid = out.get(timeout=60)
    finally:
        child.join(60)
    assert n == 0 and pid == child.pid  # the parent's parked pool (no threads in the child) was not handed out


def test_a_store_opened_per_save_starts_no_threads_after_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    import ckptio

    started = _threads_started(monkeypatch)
    state = {"a": np.arange(1 << 16, dtype=np.float32)}
    counts = []
    for step in range(3):
        before = started[0]
        ckptio.save(str(tmp_path), state, step=step).result()  # a store of its own, closed after the save
        counts.append(started[0] - before)
        out = ckptio.restore(str(tmp_path), step)
        assert (out["a"] == state["a"]).all()
    assert counts[0] > 4  # the first save starts its IO and checksum threads ...
    assert max(counts[1:]) <= 2, counts  # ... the next ones at most their lease's heartbeat


def test_a_slot_takes_once_releases_and_takes_again() -> None:
    from ckptio.system.poolshelf import PoolSlot

    slot = PoolSlot("t-slot", 2, started=True)
    assert slot.pool is None
    pool = slot.get()
    assert slot.get() is pool and len(pool._threads) == 2
    slot.release()
    slot.release()  # twice: nothing more parked
    assert slot.pool is None and parked("t-slot") == 1
    assert slot.get() is pool  # taken back from the shelf
