"""A deleter paused for minutes never takes a checkpoint committed at its step while it slept.

The scenario (an old job's retention paused, a new job that rolled back and saved the same step
again): deleter D reads step S's manifest (checkpoint A) and stalls; meanwhile another process
deletes S and saves S anew (checkpoint B), which commits; D wakes. Its revocations come too late
for B (B's fence already says commit), so D must see B and leave it whole: the deleter's step 2 of
:mod:`ckptio.store.fence`. Without it, D deleted B's objects and manifest: a committed checkpoint lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import ckptio
from ckptio.backends import Backend, open_backend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.manifest import TOMBSTONE_NAME
from ckptio.store import CheckpointStore

STEP = 7


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.integers(0, 9, 100)}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _save(root: Path, seed: int) -> None:
    ckptio.save(str(root), _state(seed), STEP).result()


def _delete_and_resave(root: Path) -> None:
    """Another process: delete step S, save S again (checkpoint B), committed."""
    other = CheckpointStore(str(root))
    try:
        run_sync(other.delete(str(STEP)))
    finally:
        run_sync(other.close())
    _save(root, seed=2)


class StallBefore(WrapperBackend):
    """Runs ``meanwhile`` (in a thread) the first time this deleter creates or deletes a key ``when``
    accepts: the deleter is paused there while another process works on the same root."""

    def __init__(self, inner: Backend, when: Callable[[str, str], bool], meanwhile: Callable[[], None]) -> None:
        super().__init__(inner)
        self.when, self.meanwhile, self.stalled = when, meanwhile, False

    async def _maybe(self, op: str, key: str) -> None:
        if not self.stalled and self.when(op, key):
            self.stalled = True
            await asyncio.to_thread(self.meanwhile)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self._maybe("create", key)
        await super().create_if_absent(key, data)

    async def delete(self, key: str) -> None:
        await self._maybe("delete", key)
        await super().delete(key)


STALLS = {
    # after reading A's manifest, before its tombstone: B commits before any revocation
    "before-tombstone": lambda op, key: op == "create" and key.endswith(TOMBSTONE_NAME),
    # amid A's objects, before the manifest: B commits after the revocations, before the manifest goes
    "amid-objects": lambda op, key: op == "delete" and key.startswith(f"{STEP}/") and "ckptio." not in key,
}


@pytest.mark.parametrize("stall", sorted(STALLS))
def test_a_deleter_paused_past_a_delete_and_resave_of_its_step_leaves_the_resave_whole(
        tmp_path: Path, stall: str) -> None:
    root = tmp_path / "ck"
    _save(root, seed=1)  # checkpoint A

    backend = StallBefore(open_backend(str(root)), STALLS[stall], lambda: _delete_and_resave(root))
    deleter = CheckpointStore(str(root), backend=backend)
    try:
        run_sync(deleter.delete(str(STEP)))
    finally:
        run_sync(deleter.close())
    assert backend.stalled, "the deleter never reached the pause this test is about"
    assert not (root / str(STEP) / TOMBSTONE_NAME).exists(), "the paused deleter left its tombstone"
    assert _same(ckptio.restore(str(root), step=STEP), _state(2)), "the re-saved checkpoint is not whole"
    assert ckptio.CheckpointManager(str(root)).latest_step() == STEP


class ResaveThenSweepAroundTheTombstone(WrapperBackend):
    """Before this deleter's tombstone: a delete and re-save of its step; right after it: a sweep."""

    def __init__(self, inner: Backend, resave: Callable[[], None], sweep: Callable[[], None]) -> None:
        super().__init__(inner)
        self.resave, self.sweep, self.stalled = resave, sweep, False

    async def create_if_absent(self, key: str, data: bytes) -> None:
        first = not self.stalled and key.endswith(TOMBSTONE_NAME)
        if first:
            self.stalled = True
            await asyncio.to_thread(self.resave)
        await super().create_if_absent(key, data)
        if first:
            await asyncio.to_thread(self.sweep)


def test_gc_meeting_a_paused_deleters_stale_tombstone_keeps_the_checkpoint_committed_there(tmp_path: Path) -> None:
    """The tombstone a paused deleter writes over a step re-saved meanwhile names the old checkpoint:
    gc (or a save) finishing "the interrupted deletion" must not take the new one."""
    root = tmp_path / "ck"
    _save(root, seed=1)
    swept: list[object] = []

    def sweep() -> None:
        gc = CheckpointStore(str(root))
        try:
            swept.append(run_sync(gc.sweep(0)))
        finally:
            run_sync(gc.close())
        with pytest.raises(FileExistsError, match="already committed"):  # a save there meets it too
            _save(root, seed=3)

    backend = ResaveThenSweepAroundTheTombstone(open_backend(str(root)), lambda: _delete_and_resave(root), sweep)
    deleter = CheckpointStore(str(root), backend=backend)
    try:
        run_sync(deleter.delete(str(STEP)))
    finally:
        run_sync(deleter.close())
    assert backend.stalled and swept
    assert not (root / str(STEP) / TOMBSTONE_NAME).exists()
    assert _same(ckptio.restore(str(root), step=STEP), _state(2))
