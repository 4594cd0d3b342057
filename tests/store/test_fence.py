"""Fencing (ckptio.store.fence): a save frozen past its lease never commits what a deleter took.

Each test freezes a saver at one exact point of its commit -- every storage call it makes
from then on (heartbeats included) waits, as in a paused process -- lets its lease run
out, runs gc (grace 0) or retention from another store on the same root, then thaws it.
Whatever the point, no committed step may fail to restore and the last restorable step
survives. Real-process pauses (SIGSTOP) are in tests/scenarios/test_paused_saves.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.base import ObjectInfo
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import SaveFailedError, SaveRevokedError
from ckptio.manifest import MANIFEST_NAME
from ckptio.manifest.names import REVOKED_DIR, parse_fence
from ckptio.store import CheckpointStore
from ckptio.store.fence import COMMIT, REVOKED

LEASE_S = 0.6


class Freezer(WrapperBackend):
    """Freezes every call once ``when(op, key)`` first holds, until :meth:`thaw`: a paused process."""

    def __init__(self, inner: object, when: Callable[[str, str], bool]) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.when = when
        self.frozen = threading.Event()
        self._thawed = threading.Event()

    def thaw(self) -> None:
        self._thawed.set()

    async def _gate(self, op: str, key: str) -> None:
        if not self.frozen.is_set() and not self._thawed.is_set() and self.when(op, key):
            self.frozen.set()
        if self.frozen.is_set() and not self._thawed.is_set():
            await asyncio.to_thread(self._thawed.wait)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self._gate("write", key)
        await super().write(key, buffers)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._gate("create", key)
        await super().create_if_absent(key, data)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        await self._gate("list", prefix)
        return await super().list(prefix)

    async def stat(self, key: str) -> ObjectInfo:
        await self._gate("stat", key)
        return await super().stat(key)

    async def delete(self, key: str) -> None:
        await self._gate("delete", key)
        await super().delete(key)


def state_for(step: int) -> dict[str, object]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 65)).astype(np.float32), "big": rng.integers(0, 255, 300_000, np.uint8),
            "step": step}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


#: Where the commit freezes: before its manifest, before it lists revocations, before it claims its fence.
POINTS: dict[str, Callable[[str, str], bool]] = {
    "before-manifest": lambda op, key: op == "create" and key.endswith(MANIFEST_NAME),
    "before-revocation-check": lambda op, key: op == "list" and key.startswith(REVOKED_DIR),
    "before-fence-claim": lambda op, key: op == "create" and parse_fence(key) is not None,
}


def gc_now(root: Path) -> None:
    store = CheckpointStore(root)
    try:
        run_sync(store.sweep(0))
    finally:
        run_sync(store.close())


def check_root(root: Path, expect_restorable: set[int]) -> None:
    """Every step ckptio lists as committed restores bit-exact, and ``expect_restorable`` is among them."""
    store = CheckpointStore(root)
    try:
        intact = run_sync(store.intact_steps(whole=True))
    finally:
        run_sync(store.close())
    for step in intact:
        assert same(state_for(step), ckptio.restore(root, step=step)), step
    assert expect_restorable <= set(intact), (intact, expect_restorable)
    latest = ckptio.restore(root)
    assert latest["step"] == max(intact)


@pytest.fixture(autouse=True)
def short_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTIO_LEASE_S", str(LEASE_S))


def freeze_run_gc(freezer: Freezer, root: Path, finish: Callable[[], object]) -> BaseException | None:
    """Run ``finish`` (the save's wait) in a thread; once frozen, outlive the lease, gc, thaw."""
    out: list[BaseException | None] = [None]

    def wait() -> None:
        try:
            finish()
        except BaseException as e:  # noqa: BLE001 -- the outcome under test
            out[0] = e

    t = threading.Thread(target=wait)
    t.start()
    assert freezer.frozen.wait(30), "the save never reached the freeze point"
    time.sleep(LEASE_S * 2)
    gc_now(root)
    freezer.thaw()
    t.join(60)
    assert not t.is_alive()
    return out[0]


@pytest.mark.parametrize("point", sorted(POINTS))
def test_frozen_plain_save_is_rolled_back_after_gc(tmp_path: Path, point: str) -> None:
    ckptio.save(tmp_path, state_for(1), step=1).result()
    freezer = Freezer(open_backend(str(tmp_path)), POINTS[point])
    handle = ckptio.save(tmp_path, state_for(2), step=2, backend=freezer)
    err = freeze_run_gc(freezer, tmp_path, handle.result)
    assert isinstance(err, SaveRevokedError), repr(err)
    gc_now(tmp_path)
    check_root(tmp_path, {1})
    assert not (tmp_path / "2" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("point", sorted(POINTS))
def test_frozen_manager_save_keeps_the_last_good_step(tmp_path: Path, point: str) -> None:
    with ckptio.CheckpointManager(tmp_path, max_to_keep=1) as m:
        m.save(1, state_for(1))
    freezer = Freezer(open_backend(str(tmp_path)), POINTS[point])
    mngr = ckptio.CheckpointManager(tmp_path, max_to_keep=1, backend=freezer)
    mngr.save(2, state_for(2))
    err = freeze_run_gc(freezer, tmp_path, mngr.wait_until_finished)
    assert isinstance(err, SaveFailedError), repr(err)
    check_root(tmp_path, {1})  # retention did not delete step 1 for a step 2 that never stood
    mngr._pending = None
    mngr.save(3, state_for(3))  # the run goes on
    mngr.close()
    check_root(tmp_path, {3})


def test_frozen_after_its_fence_the_commit_stands(tmp_path: Path) -> None:
    """Frozen once its fence says commit (reading its manifest back): gc must keep every object."""
    claimed: list[str] = []

    def after_claim(op: str, key: str) -> bool:
        if op == "create" and parse_fence(key) is not None:
            claimed.append(key)
        return bool(claimed) and op == "stat" and key.endswith(MANIFEST_NAME)

    freezer = Freezer(open_backend(str(tmp_path)), after_claim)
    store = CheckpointStore(tmp_path, backend=freezer)
    handle = ckptio.save(tmp_path, state_for(5), step=5, backend=freezer)
    err = freeze_run_gc(freezer, tmp_path, handle.result)
    assert err is None, repr(err)
    run_sync(store.close())
    check_root(tmp_path, {5})


def test_gc_revokes_an_unconfirmed_dead_commit_and_a_late_claim_loses(tmp_path: Path) -> None:
    """A manifest whose writer died before confirming: gc claims its fence 'revoked' and removes it;
    the writer's claim, landing late, finds the fence taken."""
    ckptio.save(tmp_path, state_for(1), step=1).result()
    freezer = Freezer(open_backend(str(tmp_path)), POINTS["before-fence-claim"])
    handle = ckptio.save(tmp_path, state_for(2), step=2, backend=freezer)
    assert freezer.frozen.wait(30)
    time.sleep(LEASE_S * 2)
    store = CheckpointStore(tmp_path)
    assert run_sync(store.status("2")).state in ("incomplete", "in-flight")  # never "committed"
    run_sync(store.sweep(0))
    fences = [k for k in (tmp_path / "2").iterdir()] if (tmp_path / "2").exists() else []
    assert not any(f.name == MANIFEST_NAME for f in fences)
    freezer.thaw()
    with pytest.raises(SaveRevokedError):
        handle.result()
    run_sync(store.close())
    check_root(tmp_path, {1})


def test_revocations_are_kept_and_never_block_a_new_save(tmp_path: Path) -> None:
    freezer = Freezer(open_backend(str(tmp_path)), POINTS["before-manifest"])
    handle = ckptio.save(tmp_path, state_for(2), step=2, backend=freezer)
    assert isinstance(freeze_run_gc(freezer, tmp_path, handle.result), SaveRevokedError)
    gc_now(tmp_path)
    assert list((tmp_path / REVOKED_DIR).iterdir())  # kept: the revoked save may wake again
    ckptio.save(tmp_path, state_for(2), step=2).result()  # a new attempt has a new id
    check_root(tmp_path, {2})


def test_fence_outcomes_are_claimed_once(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    try:
        assert run_sync(store.fences.claim("3", "0123456789ab", REVOKED)) == REVOKED
        assert run_sync(store.fences.claim("3", "0123456789ab", COMMIT)) == REVOKED
        assert run_sync(store.fences.claim("3", "ba9876543210", COMMIT)) == COMMIT
        assert run_sync(store.fences.outcome("3", "ba9876543210")) == COMMIT
        assert run_sync(store.fences.outcome("3", "aaaaaaaaaaaa")) is None
    finally:
        run_sync(store.close())


def test_a_rolled_back_commits_fence_is_swept(tmp_path: Path) -> None:
    """A commit that lost to a revocation leaves its fence ("revoked") and no manifest: gc takes it."""
    freezer = Freezer(open_backend(str(tmp_path)), POINTS["before-revocation-check"])
    handle = ckptio.save(tmp_path, state_for(2), step=2, backend=freezer)
    assert isinstance(freeze_run_gc(freezer, tmp_path, handle.result), SaveRevokedError)
    gc_now(tmp_path)
    left = [p.name for p in (tmp_path / "2").iterdir()] if (tmp_path / "2").exists() else []
    assert left == [], left
    ckptio.save(tmp_path, state_for(3), step=3).result()
    gc_now(tmp_path)  # a committed step's own fence stays
    assert len(list((tmp_path / "3").glob("ckptio.fence.*"))) == 1
    check_root(tmp_path, {3})
