"""A tiered restore deletes nothing (issue 30): the steps newer than the one restored are retired by the
first save after the restore, when training has moved on from it -- never by the restore itself.

One process here (fast and durable tiers); the same on two hosts with a peer tier at the end (gloo).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptio.backends import Backend, open_backend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.tiers import DURABLE, LOCAL, Retention, TieredCheckpointManager, TierPolicy

#: Every step stays in both tiers unless retired, so that what a restore or a save deletes shows.
KEEP_ALL = TierPolicy(replicate_every=1, fast=Retention(max_to_keep=10), durable=Retention(max_to_keep=10))


def state(step: int, gen: int = 0) -> dict[str, Any]:
    """The state saved at ``step``; ``gen``: another timeline's state at the same step (after a rollback)."""
    rng = np.random.default_rng(step + 1_000_003 * gen)
    return {
        "w": rng.standard_normal((64, 33)).astype(np.float32),
        "v": rng.integers(0, 1 << 30, size=(5000,), dtype=np.int64),
        "step": step,
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["step"] == b["step"] and all(a[k].tobytes() == b[k].tobytes() for k in ("w", "v")))


def saved(tmp_path: Path, steps: Sequence[int], policy: TierPolicy = KEEP_ALL,
          durable_backend: Backend | None = None) -> TieredCheckpointManager:
    """A manager whose fast and durable tiers hold ``steps`` (generation 0), all replicated."""
    m = TieredCheckpointManager(str(tmp_path / "fast"), None if durable_backend else str(tmp_path / "durable"),
                                durable_backend=durable_backend, policy=policy)
    for s in steps:
        m.save(s, state(s))
    m.wait_until_finished()
    assert m.tier_steps() == {"fast": list(steps), "peer": [], "durable": list(steps)}
    return m


def test_restoring_an_older_step_keeps_every_newer_one_until_the_next_save(tmp_path: Path) -> None:
    with saved(tmp_path, [1, 2, 3, 4, 5]) as m:
        before = m.tier_steps()
        assert same(m.restore(step=2), state(2))
        assert m.tier_steps() == before and m.resumed_from == 2
        # Every newer step is still restorable from each tier; these look-only restores leave the resume at 2.
        for s in (3, 4, 5):
            for tier in (LOCAL, DURABLE):
                assert same(m.restore(step=s, tiers=(tier,), retire_newer=False), state(s))
                assert m.last_restore is not None and m.last_restore.sources == {0: tier}
        assert m.tier_steps() == before and m.resumed_from == 2
        old_id = run_sync(m.fast.read_manifest("3")).checkpoint_id

        # Training goes on from 2 on another timeline: its first save retires 3..5 first, in both tiers,
        # so that step 3 is saved again rather than skipped as already held.
        h = m.save(3, state(3, gen=1))
        assert h is not None
        m.wait_until_finished()
        assert m.resumed_from is None
        assert m.tier_steps() == {"fast": [1, 2, 3], "peer": [], "durable": [1, 2, 3]}
        assert run_sync(m.fast.read_manifest("3")).checkpoint_id != old_id
        for tier in (LOCAL, DURABLE):
            assert same(m.restore(tiers=(tier,)), state(3, gen=1))
            assert m.last_restore is not None and m.last_restore.step == 3
        # That restore was of the newest step: the next save has nothing newer to retire.
        assert m.save(4, state(4, gen=1)) is not None
        m.wait_until_finished()
        assert m.tier_steps()["fast"] == [1, 2, 3, 4]
    with TieredCheckpointManager(str(tmp_path / "fast"), str(tmp_path / "durable"), policy=KEEP_ALL) as m:
        assert same(m.restore(), state(4, gen=1))


def test_restoring_the_newest_again_without_a_save_deletes_nothing(tmp_path: Path) -> None:
    with saved(tmp_path, [1, 2, 3, 4]) as m:
        before = m.tier_steps()
        assert same(m.restore(step=1), state(1))
        assert same(m.restore(), state(4))  # the resume is now from the newest step
        assert m.resumed_from == 4 and m.tier_steps() == before
    # Closing without a save leaves every step; a new run resumes from the newest as saved.
    with TieredCheckpointManager(str(tmp_path / "fast"), str(tmp_path / "durable"), policy=KEEP_ALL) as m:
        assert m.tier_steps() == before and m.resumed_from is None
        for s in (1, 2, 3, 4):
            assert same(m.restore(step=s, retire_newer=False), state(s))
        assert m.tier_steps() == before


def test_without_a_resume_a_save_of_a_held_step_deletes_nothing(tmp_path: Path) -> None:
    """As before the change: a save of a step every host holds is skipped; look-only restores resume nothing."""
    with saved(tmp_path, [1, 2, 3]) as m:
        before = m.tier_steps()
        assert same(m.restore(step=1, retire_newer=False), state(1))
        assert m.resumed_from is None
        assert m.save(2, state(2, gen=1)) is None
        with pytest.raises(FileExistsError):
            m.save(3, state(3, gen=1), force=True)
        assert m.tier_steps() == before
        assert same(m.restore(step=2, retire_newer=False), state(2))


def test_a_save_off_the_interval_defers_the_retirement(tmp_path: Path) -> None:
    policy = TierPolicy(replicate_every=2, save_interval_steps=2, fast=Retention(max_to_keep=10),
                        durable=Retention(max_to_keep=10))
    with saved(tmp_path, [2, 4, 6], policy=policy) as m:
        before = m.tier_steps()
        assert same(m.restore(step=2), state(2))
        assert m.save(3, state(3, gen=1)) is None  # not saved, so nothing is retired yet
        assert m.tier_steps() == before and m.resumed_from == 2
        assert m.save(4, state(4, gen=1)) is not None
        m.wait_until_finished()
        assert m.tier_steps() == {"fast": [2, 4], "peer": [], "durable": [2, 4]}
        assert same(m.restore(), state(4, gen=1))


class FailingDeletes(WrapperBackend):
    """The next ``fail`` deletes raise (a durable tier refusing deletes for a while)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.fail = 0

    async def delete(self, key: str) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise OSError(f"injected: cannot delete {key}")
        await self.inner.delete(key)


def test_a_failed_retirement_saves_nothing_and_the_next_save_retires_again(tmp_path: Path) -> None:
    durable = FailingDeletes(open_backend(str(tmp_path / "durable")))
    with saved(tmp_path, [1, 2, 3, 4], durable_backend=durable) as m:
        assert same(m.restore(step=2), state(2))
        durable.fail = 1
        with pytest.raises(OSError, match="retiring the newer steps failed"):
            m.save(3, state(3, gen=1))
        assert m.resumed_from == 2  # still owed: a leftover step 3 would make the save skip it
        assert m.save(3, state(3, gen=1)) is not None
        m.wait_until_finished()
        assert m.tier_steps() == {"fast": [1, 2, 3], "peer": [], "durable": [1, 2, 3]}
        assert same(m.restore(tiers=(DURABLE,)), state(3, gen=1))


# -- two hosts (gloo): a peer tier too, and every host deciding alike ------------------------------------


@pytest.mark.slow
def test_two_hosts_restore_an_older_step_then_resume_from_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.tiers.test_tiers_mp import run

    root = str(tmp_path)
    common = ["--every", "2", "--keep", "2"]
    saved_ = run(2, "save", root, "--steps", "1,2,3,4", *common)
    before = {r: saved_[r]["tiers"] for r in saved_}
    assert before[0] == {"fast": [3, 4], "peer": [4], "durable": [2, 4]}, before
    # A restore of step 2 alone (from the durable tier) deletes nothing on any host...
    got = run(2, "restore", root, "--restore-step", "2", "--expect-step", "2", *common)
    assert {r: got[r]["tiers"] for r in got} == before, got
    # ... so a later restore still finds the newest step in the fast tiers, as first saved.
    got = run(2, "restore", root, "--expect-step", "4", *common)
    assert all(r["sources"] == {"0": "local", "1": "local"} and r["tiers"] == before[r["rank"]]
               for r in got.values()), got
    # Resuming from 2 and saving 3 again retires 3 and 4 everywhere first: the new step 3 is the newest.
    got = run(2, "resume", root, "--restore-step", "2", "--expect-step", "2", "--steps", "3", "--gen", "1",
              *common)
    assert all(r["error"] is None and r["saved"] == [3] for r in got.values()), got
    assert all(r["tiers"] == {"fast": [3], "peer": [3], "durable": [2]} for r in got.values()), got
    run(2, "restore", root, "--expect-step", "3", "--gen", "1", *common)
