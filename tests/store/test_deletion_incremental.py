"""Deletion follows references (docs/incremental.md, section 3): an object is deleted only when no
committed manifest of a kept step and no live save references it.

Step 3 references objects of steps 1 and 2 (built in tests/manifest/test_refs.py). Deterministic
cases first; then Hypothesis interleaves, one storage request at a time, a referencing save
(alive, or paused past its lease) with deleters and gc, and checks that every step that counts
restores bit-exact, and that once everything settles the objects left are exactly those that
committed manifests name.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.manifest.test_refs import planned, referencing, states

import ckptio
from ckptio.backends import Backend
from ckptio.backends.base import ByteRange, ObjectInfo
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import CheckpointNotFoundError, SaveRevokedError
from ckptio.manifest.names import new_id, parse_object
from ckptio.store import CheckpointStore
from ckptio.store.pins import PIN_DIR, parse_pin, pin_key

_URLS = itertools.count()


def objects_on_disk(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and parse_object(str(p.relative_to(root)))}


def test_deleting_the_bases_keeps_what_a_later_step_references(tmp_path: Path) -> None:
    store, m3, two = referencing(tmp_path)
    run_sync(store.delete("1"))
    run_sync(store.delete("2"))
    got = ckptio.restore(str(tmp_path), step=3)
    assert all(got[k].tobytes() == two[k].tobytes() for k in ("frozen", "moving"))
    assert objects_on_disk(tmp_path) == set(m3.objects)  # the bases' other objects went
    assert run_sync(store.committed_steps()) == [3]


def test_gc_keeps_referenced_objects_and_takes_them_once_the_reference_goes(tmp_path: Path) -> None:
    store, m3, _two = referencing(tmp_path)
    run_sync(store.delete("1"))
    run_sync(store.sweep(grace_seconds=0))
    assert set(m3.objects) <= objects_on_disk(tmp_path)
    run_sync(store.delete("3"))  # step 1's leftovers are nobody's now; step 2 still stands
    run_sync(store.sweep(grace_seconds=0))
    kept = set(run_sync(store.read_manifest("2")).objects)
    assert objects_on_disk(tmp_path) == kept
    assert not list((tmp_path / PIN_DIR).glob("*"))  # the dead pins went with them


def test_a_live_referencing_save_keeps_every_object_of_a_deleted_base(tmp_path: Path) -> None:
    store, m3, _m1, two = planned(str(tmp_path))
    before = objects_on_disk(tmp_path)
    run_sync(store.announce("3", m3.checkpoint_id, lease_s=3600))
    for base, cid in m3.bases.items():
        assert run_sync(store.deletion.pins.pin(base, "3", m3.checkpoint_id, cid))
    run_sync(store.delete("1"))
    run_sync(store.sweep(grace_seconds=0))
    assert objects_on_disk(tmp_path) == before  # it may reference any of them: all stay
    run_sync(store.commit("3", m3))
    run_sync(store.retire("3", m3.checkpoint_id))
    got = ckptio.restore(str(tmp_path), step=3)
    assert got["frozen"].tobytes() == two["frozen"].tobytes()


def test_a_pin_after_the_tombstone_references_nothing(tmp_path: Path) -> None:
    store, m3, m1, _two = planned(str(tmp_path))
    (tmp_path / "1" / "ckptio.deleting").write_bytes(m1.checkpoint_id.encode())  # a deletion under way
    assert not run_sync(store.deletion.pins.pin("1", "3", m3.checkpoint_id, m1.checkpoint_id))
    assert not list((tmp_path / PIN_DIR).glob("1.*"))  # it took its pin back
    assert not list((tmp_path / "1").glob(f"ckptio.intent.{m3.checkpoint_id}"))  # and its hold


def test_a_flattened_pin_waits_for_a_deletion_under_way_and_never_checks_during_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 is being deleted (another host's retention) as a save of step 3 pins it through base 2:
    the pin waits for that deletion to end instead of failing the save, and one that does not end in
    time is given up (no check while a deletion runs: its D2 may judge step 2's pin after step 2 went)."""
    import ckptio.store.pins as pins_mod

    store, m3, m1, _two = planned(str(tmp_path))
    tomb = tmp_path / "1" / "ckptio.deleting"
    tomb.write_bytes(m1.checkpoint_id.encode())
    loop = asyncio.new_event_loop()
    try:
        async def ends_later() -> bool:
            asyncio.get_running_loop().call_later(0.3, tomb.unlink)
            return await store.deletion.pins.pin("1", "3", m3.checkpoint_id, m3.bases["2"], via="2")

        assert loop.run_until_complete(ends_later())  # waited, then pinned
        assert list((tmp_path / PIN_DIR).glob("1.3.*"))
        tomb.write_bytes(m1.checkpoint_id.encode())  # a deletion that does not end in time
        monkeypatch.setattr(pins_mod, "DELETION_WAIT_S", 0.2)
        assert not loop.run_until_complete(
            store.deletion.pins.pin("1", "3", new_id(), m3.bases["2"], via="2"))
    finally:
        loop.close()
    assert len(list((tmp_path / PIN_DIR).glob("1.3.*"))) == 1  # the second took its pin back


def test_a_flattened_pin_waits_for_a_deletion_that_begins_after_its_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other host's retention starts deleting step 1 a moment after this save's pin waited for
    no deletion (the race a 2-host job lost about 1 run in 8): the pin waits for that one too and
    pins, never checking while the tombstone stands."""
    store, m3, m1, _two = planned(str(tmp_path))
    pins = store.deletion.pins
    tomb = tmp_path / "1" / "ckptio.deleting"
    waits: list[int] = []
    seen_during: list[bool] = []
    real_wait, real_stands = pins._deletion_over, pins._stands

    async def wait_then_a_deletion_begins(step_dir: str, limit_s: float) -> None:
        await real_wait(step_dir, limit_s)
        waits.append(1)
        if len(waits) == 2:  # after the wait that follows the pin: retention begins, ends 0.3 s later
            tomb.write_bytes(m1.checkpoint_id.encode())
            asyncio.get_running_loop().call_later(0.3, tomb.unlink)

    async def stands(step_dir: str, checkpoint_id: str) -> bool:
        seen_during.append(tomb.exists())
        return await real_stands(step_dir, checkpoint_id)

    monkeypatch.setattr(pins, "_deletion_over", wait_then_a_deletion_begins)
    monkeypatch.setattr(pins, "_stands", stands)
    assert run_sync(pins.pin("1", "3", m3.checkpoint_id, m3.bases["2"], via="2"))
    assert len(waits) == 3 and not any(seen_during)  # waited again; never judged during the deletion
    assert list((tmp_path / PIN_DIR).glob("1.3.*"))


def test_a_paused_referencing_save_is_revoked_and_cannot_commit(tmp_path: Path) -> None:
    """The save pins step 1, then stalls past its lease; a deleter judges it dead, revokes it and
    deletes step 1 whole. The save wakes and commits: its manifest never counts."""
    store, m3, _m1, _two = planned(str(tmp_path))
    run_sync(store.announce("3", m3.checkpoint_id, lease_s=0.001))
    for base, cid in m3.bases.items():
        assert run_sync(store.deletion.pins.pin(base, "3", m3.checkpoint_id, cid))
    run_sync(asyncio.sleep(0.05))  # its lease runs out: it looks dead
    run_sync(store.delete("1"))
    assert not any(k.startswith("1/") for k in objects_on_disk(tmp_path))
    with pytest.raises((SaveRevokedError, FileNotFoundError)):
        run_sync(store.commit("3", m3))
    with pytest.raises(CheckpointNotFoundError):
        run_sync(store.read_manifest("3"))


def test_a_revoked_save_that_wrote_nothing_of_its_own_still_fails_its_commit(tmp_path: Path) -> None:
    """The fence's check matches the manifest's own id: step 3 names no key of its own save."""
    store, m3, _m1, _two = planned(str(tmp_path))
    run_sync(store.fences.revoke("3", [m3.checkpoint_id]))
    with pytest.raises(SaveRevokedError):
        run_sync(store.commit("3", m3))
    with pytest.raises(CheckpointNotFoundError):
        run_sync(store.read_manifest("3"))


# -- interleavings, one storage request at a time -------------------------------------------


#: Which racer (top-level task) a request belongs to: a context variable, so that the subtasks
#: a store spawns (gather_or_cancel) inherit it.
RACER: contextvars.ContextVar[int] = contextvars.ContextVar("racer", default=0)


class Turns(WrapperBackend):
    """Every request waits for its turn; :meth:`run` hands turns out to the racers in the runs
    ``picks`` says (the storage sees the racers' requests in any interleaving)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.waiting: list[tuple[int, asyncio.Future[None]]] = []
        self.busy = 0
        self.granted: dict[int, int] = {}  # requests let through, by racer

    async def _turn(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((RACER.get(), fut))
        await fut
        self.busy += 1

    async def _call(self, coro: Awaitable[Any]) -> Any:
        await self._turn()
        try:
            return await coro
        finally:
            self.busy -= 1

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._call(self.inner.write(key, buffers))

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self._call(self.inner.read_into(key, rng, buffers))

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._call(self.inner.create_if_absent(key, data))

    async def delete(self, key: str) -> None:
        await self._call(self.inner.delete(key))

    async def stat(self, key: str) -> ObjectInfo:
        return await self._call(self.inner.stat(key))

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._call(self.inner.list(prefix))

    async def run(self, racers: list[Callable[[], Awaitable[Any]]], picks: list[tuple[int, int]]) -> list[Any]:
        """Run ``racers`` to the end, each pick ``(racer, n)`` giving the next ``n`` turns to that
        racer (modulo those waiting), then the oldest request first. Between turns every racer runs
        until it waits for a turn or is done, so that the same picks replay the same interleaving.
        Returns the racers' results (raises the first one's error)."""

        async def as_racer(i: int, fn: Callable[[], Awaitable[Any]]) -> Any:
            RACER.set(i)
            return await fn()

        tasks = [asyncio.ensure_future(as_racer(i, fn)) for i, fn in enumerate(racers)]
        order = iter(picks)
        racer, left = 0, 0
        while not all(t.done() for t in tasks):
            await self._settle()
            self.waiting = [(r, f) for r, f in self.waiting if not f.done()]
            if not self.waiting:
                continue
            if left <= 0:
                racer, left = next(order, (0, 1 << 30))
            racers_waiting = sorted({r for r, _ in self.waiting})
            who = racers_waiting[racer % len(racers_waiting)]
            i = next(i for i, (r, _) in enumerate(self.waiting) if r == who)
            self.waiting.pop(i)[1].set_result(None)
            self.granted[who] = self.granted.get(who, 0) + 1
            left -= 1
        return [t.result() for t in tasks]

    async def _settle(self) -> None:
        for _ in range(100):
            await asyncio.sleep(0)
        while self.busy:
            await asyncio.sleep(0.001)
            for _ in range(100):
                await asyncio.sleep(0)


async def _saver(store: CheckpointStore, m3: Any, via: tuple[str, str] | None = None) -> str:
    """An incremental save of step 3, announced already: pin the owners of what it references (R1,
    R2; ``via``: the base it read them from, and its checkpoint id), commit. Its outcome."""
    for base, cid in m3.bases.items():
        ok = await (store.deletion.pins.pin(base, "3", m3.checkpoint_id, cid) if via is None else
                    store.deletion.pins.pin(base, "3", m3.checkpoint_id, via[1], via=via[0]))
        if not ok:
            await store.deletion.pins.unpin(pin_key(b, "3", m3.checkpoint_id) for b in m3.bases)
            await store.retire("3", m3.checkpoint_id)
            return "wrote in full"  # (it would write the shards itself)
    try:
        await store.commit("3", m3)
    except (SaveRevokedError, FileNotFoundError, OSError) as e:
        return f"failed: {type(e).__name__}"
    finally:
        await store.retire("3", m3.checkpoint_id)
    return "committed"


async def plain_announce(url: str, save_id: str, alive: bool) -> None:
    """The saver's intent: beating (alive), or stale already (paused past its lease)."""
    await CheckpointStore(url).announce("3", save_id, lease_s=3600 if alive else 0.001)
    if not alive:
        await asyncio.sleep(0.02)


_DELETERS: dict[str, Callable[[CheckpointStore], Awaitable[Any]]] = {
    "delete 1": lambda s: s.delete("1"),
    "delete 2": lambda s: s.delete("2"),
    "gc": lambda s: s.sweep(grace_seconds=0),
    "delete 1, gc": lambda s: _then(s.delete("1"), s.sweep(grace_seconds=0)),
}


async def _then(*coros: Awaitable[Any]) -> None:
    for c in coros:
        await c


def _check(url: str, store: CheckpointStore, expected: dict[str, dict[str, np.ndarray]]) -> set[str]:
    """Every step that counts restores bit-exact; returns the keys their manifests name."""
    named: set[str] = set()
    for step in run_sync(store.committed_steps()):
        got = ckptio.restore(url, step=step)
        want = expected[str(step)]
        assert all(got[k].tobytes() == want[k].tobytes() for k in ("frozen", "moving")), step
        named |= set(run_sync(store.read_manifest(str(step))).keys())
    return named


def chained(url: str) -> tuple[CheckpointStore, Any, Any, dict[str, Any]]:
    """Step 1 in full, step 2 incremental (its ``frozen`` in step 1's object), and the manifest of
    a step 3 that references all of step 2 (owners 1 and 2, read via base 2), not committed."""
    one, two = states()
    mngr = ckptio.CheckpointManager(url, incremental=True)
    for step, st_ in ((1, one), (2, two)):
        mngr.save(step, st_, force=True)
        mngr.wait_until_finished()
    store = CheckpointStore(url)
    m2 = run_sync(store.read_manifest("2"))
    assert m2.bases and "1" in m2.bases
    m3 = dataclasses.replace(m2, step=3, checkpoint_id=new_id(), fence=None,
                             bases={**m2.bases, "2": m2.checkpoint_id})
    return store, m3, m2, two


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(alive=st.booleans(), chain=st.booleans(),
       deleters=st.lists(st.sampled_from(sorted(_DELETERS)), min_size=1, max_size=2),
       picks=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12)), max_size=60))
def test_interleavings_of_a_referencing_save_with_deleters_lose_nothing(
        alive: bool, chain: bool, deleters: list[str], picks: list[tuple[int, int]]) -> None:
    """``picks``: runs of turns, ``(racer, how many)`` (see :meth:`Turns.run`). ``chain``: the
    save's references are flattened through an incremental base (step 2, whose ``frozen`` lies in
    step 1): it pins both owners via step 2."""
    _race(alive, chain, deleters, picks)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("alive", [False, True])
def test_a_deleter_paused_after_each_of_its_requests_while_a_referencing_save_runs(alive: bool, chain: bool) -> None:
    """The deleter of step 1 makes ``k`` requests, stalls while the save runs to its end, then wakes
    and finishes; for every ``k`` until the deleter has nothing left. Then the other way round: the
    save paused after each of its requests while the deleter runs whole."""
    for first in (1, 0):  # the deleter first (paused deleter), then the save first (paused save)
        for k in range(1, 60):
            outcome, requests = _race(alive, chain, ["delete 1"], [(first, k), (1 - first, 1 << 20)])
            if requests[first] <= k:
                break  # the paused one had finished before its pause: every k is done


def _race(alive: bool, chain: bool, deleters: list[str], picks: list[tuple[int, int]]) -> tuple[str, list[int]]:
    """One race (see the Hypothesis test); returns the saver's outcome and each racer's request count."""
    url = f"mem://incr-{next(_URLS)}"
    try:
        store, m3, base, two = (chained if chain else planned)(url)
        via = ("2", base.checkpoint_id) if chain else None
        one = {k: ckptio.restore(url, step=1)[k] for k in ("frozen", "moving")}
        expected = {"1": one, "2": two, "3": two}
        turns = Turns(MemoryBackend(url))
        racing = CheckpointStore(url, backend=turns)
        run_sync(plain_announce(url, m3.checkpoint_id, alive))
        others = [CheckpointStore(url, backend=turns) for _ in deleters]

        racers = [lambda: _saver(racing, m3, via)]
        racers += [(lambda d=d, s=s: _DELETERS[d](s)) for d, s in zip(deleters, others)]
        outcome = run_sync(turns.run(racers, picks))[0]
        requests = [turns.granted.get(i, 0) for i in range(len(racers))]
        plain = CheckpointStore(url)
        _check(url, plain, expected)
        if alive and outcome == "committed":
            assert 3 in run_sync(plain.committed_steps())
        # Settled: whatever no committed manifest names goes, and nothing else.
        run_sync(plain.sweep(grace_seconds=0))
        named = _check(url, plain, expected)
        listed = {i.key for i in run_sync(plain.backend.list(""))}
        assert {k for k in listed if parse_object(k)} == {k for k in named if parse_object(k)}, outcome
        standing = {str(s): run_sync(plain.read_manifest(str(s))).checkpoint_id
                    for s in run_sync(plain.committed_steps())}
        pins = [parse_pin(k) for k in listed if k.startswith(PIN_DIR)]
        # A pin stays while its save's commit stands; a dead save's goes once its base is deleted
        # (judged then): on a base that still stands it waits, keeping nothing (a few bytes).
        assert all(standing.get(p.step_dir) == p.save_id or p.base in standing for p in pins), (outcome, pins)
        return outcome, requests
    finally:
        MemoryBackend.forget(url)
