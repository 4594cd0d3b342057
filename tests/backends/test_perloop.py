"""PerLoop: one client object per event loop, closed with its loop (the GCS and fsspec backends' sessions)."""

from __future__ import annotations

import asyncio
import threading

from ckptio.backends._perloop import PerLoop


class _Client:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closed = False
        self.forgotten = False


def _pool(made: list[_Client]) -> PerLoop[_Client]:
    def factory(loop: asyncio.AbstractEventLoop) -> _Client:
        made.append(_Client(loop))
        return made[-1]

    async def close(c: _Client) -> None:
        assert asyncio.get_running_loop() is c.loop, "closed on a loop it does not belong to"
        c.closed = True

    async def forget(c: _Client) -> None:
        c.forgotten = True

    return PerLoop(factory, close, live=lambda c: not c.closed, forget=forget)


def test_one_object_per_loop_closed_when_the_loop_shuts_down() -> None:
    made: list[_Client] = []
    pool = _pool(made)

    async def twice() -> None:
        assert await pool.get() is await pool.get()

    asyncio.run(twice())
    assert len(made) == 1 and made[0].closed  # asyncio.run's shutdown closed it; nobody called close
    asyncio.run(twice())
    assert len(made) == 2 and made[1].closed


def test_close_current_and_close_all_reach_every_running_loop() -> None:
    made: list[_Client] = []
    pool = _pool(made)
    ready, stop = threading.Barrier(2), threading.Event()

    def other_loop() -> None:
        async def hold() -> None:
            await pool.get()
            ready.wait()
            while not stop.is_set():
                await asyncio.sleep(0.01)

        asyncio.run(hold())

    t = threading.Thread(target=other_loop)
    t.start()

    async def main() -> None:
        ready.wait()
        mine = await pool.get()
        await pool.close_current()
        assert mine.closed and not made[0].closed
        again = await pool.get()  # usable after: a new object
        assert again is not mine
        await pool.close_all()  # the other thread's object is closed on its own loop
        assert all(c.closed for c in made)

    asyncio.run(main())
    stop.set()
    t.join(10)


def test_objects_of_loops_closed_without_shutdown_are_forgotten() -> None:
    made: list[_Client] = []
    pool = _pool(made)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(pool.get())
    loop.close()  # no shutdown_asyncgens: the object cannot be closed on its loop any more

    async def next_loop() -> None:
        await pool.get()

    asyncio.run(next_loop())
    assert made[0].forgotten and not made[0].closed
