"""Saving a step again after a save of it died mid-commit: settle the dead commit as gc would, or wait.

A save killed between its manifest and its fence claim (:mod:`ckptio.store.fence`, steps 2-4) leaves
a manifest that never counts; the restarted job resumes from the step before and saves this step
again, often within the dead save's lease. Before that save:

* a commit provably dead -- none of its writers has a live intent, and its manifest is older than
  the lease (so a writer that never announced, or whose intent went, is past it too) -- is settled
  by the orphan sweep of the step (:meth:`ckptio.store.gc.Collector.sweep_step` at a grace of one
  lease: revoke, claim the fence "revoked", delete the objects, the manifest, then the fence).
  Exactly gc's judgement and gc's code: nothing here deletes on its own.
* a commit whose writer may be alive (a live intent, or a manifest younger than the lease) is
  *busy*: the new save may go ahead with its writes (its objects have their own save id) but its
  commit first waits (:meth:`Resaves.wait_free`) until that commit confirms -- the new save then
  fails, "already committed" -- or its lease ends and it is settled as above.

A step saved at the root (no step directory) has no per-step sweep: a busy root refuses the save
(:class:`~ckptio.errors.StepBusyError`) until ``ckptio gc`` settles it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError, StepBusyError
from ckptio.manifest import Manifest
from ckptio.store.commit import Commits
from ckptio.store.context import StoreContext
from ckptio.store.gc import Collector
from ckptio.store.intents import Intents
from ckptio.store.manifests import Manifests

__all__ = ["Resaves", "wait_bound"]

log = logging.getLogger("ckptio.store")


def wait_bound(lease_s: float) -> float:
    """How long a save waits for a busy step: a lease (a live writer's last heartbeat and manifest are
    at most that old once it is dead), a quarter more for heartbeats in flight, and 2 s of polling."""
    return lease_s * 1.25 + 2.0


class Resaves:
    """The checks before a save of a step that may hold another save's unconfirmed commit."""

    def __init__(
        self, ctx: StoreContext, manifests: Manifests, intents: Intents, commits: Commits, gc: Collector,
    ) -> None:
        self.ctx = ctx
        self.manifests = manifests
        self.intents = intents
        self.commits = commits
        self.gc = gc

    async def prepare(self, step_dir: str, *, defer: bool = False) -> bool:
        """:meth:`Commits.prepare_save`, settling a dead commit first; True if the step is busy.

        A busy step raises StepBusyError unless ``defer``: then True says the save may write,
        and must :meth:`wait_free` before it commits.
        """
        settled = False
        while True:
            try:
                await self.commits.prepare_save(step_dir)  # a commit that stood meanwhile: "already committed"
                return False
            except StepBusyError as e:
                if not settled and step_dir and await self._settle_if_dead(step_dir, e.manifest):  # type: ignore[arg-type]
                    settled = True
                    continue
                if not defer or not step_dir:
                    raise
                break
        log.info("%s: a save of this step may still be committing; this save waits for it to confirm or "
                 "for its lease (%g s) to end before committing", self.ctx.where(step_dir), self.ctx.lease_s)
        return True

    async def wait_free(self, step_dir: str, deadline: float) -> None:
        """Wait (polling, until ``deadline``, a ``time.time()``) until ``step_dir`` may be committed.

        Returns once no unconfirmed commit is in the way (a dead one is settled); FileExistsError
        "already committed" if the other save confirmed; StepBusyError at ``deadline``.
        """
        poll = min(max(self.ctx.lease_s / 8, 0.05), 2.0)
        while True:
            try:
                await self.commits.prepare_save(step_dir)
                return
            except StepBusyError as e:
                if step_dir and await self._settle_if_dead(step_dir, e.manifest):  # type: ignore[arg-type]
                    continue
                if time.time() >= deadline:
                    raise StepBusyError(
                        f"{e} -- still not confirmed, and its save not provably dead, when this save's wait "
                        f"for it ended ({wait_bound(self.ctx.lease_s):g} s from staging)", manifest=e.manifest
                    ) from None
            await asyncio.sleep(poll)

    async def _settle_if_dead(self, step_dir: str, manifest: Manifest | None) -> bool:
        """If ``manifest``'s commit is dead by gc's rule, have gc's sweep of the step settle it; True
        if it was judged dead (the sweep itself decides again, and keeps a commit that stood)."""
        if manifest is None:
            return False
        writers = self.ctx.writers_of(manifest.keys())
        if writers & await self.intents.live_saves(step_dir) or time.time() - manifest.created < self.ctx.lease_s:
            return False
        log.warning("%s: the save %s died before confirming its commit; settling it (as `ckptio gc` would) "
                    "before saving this step again", self.ctx.where(step_dir), manifest.checkpoint_id)
        await self.gc.sweep_step(int(step_dir), self.ctx.lease_s)
        return True

    async def commit_stands(self, step_dir: str) -> bool:
        """True if ``step_dir`` holds a commit that stands (or a damaged manifest: not ours to judge
        here); an unconfirmed one is the coordinator's to settle or wait for (:meth:`prepare`)."""
        try:
            await self.manifests.read_root(step_dir, explain=False)
        except CheckpointNotFoundError:  # absent, being deleted, or unconfirmed (UnconfirmedCommitError)
            return False
        except (ManifestError, IntegrityError):
            return True
        return True
