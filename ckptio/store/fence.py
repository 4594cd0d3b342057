"""Fencing: a save paused past its lease can never commit what a deleter took.

A lease (:mod:`ckptio.store.intents`) tells deleters "crashed" from "slow", but a
process paused for minutes (VM pause, live migration, swap, a stopped
container, a long GC) wakes believing it still holds it. So whoever deletes
a save's objects first *revokes* that save, and a commit checks for
revocations after its commit point; the one key both may create decides.

Keys (each created once, never rewritten):

* ``ckptio.revoked/<step>.<save id>`` -- a deleter's revocation, created
  before it deletes any object of that save. Never removed: a revoked save
  may wake at any time, however late. Save ids are fresh per attempt, so a
  revocation never blocks a later save.
* ``<step>/ckptio.fence.<fence id>`` -- one commit attempt's fence, beside
  its manifest; ``fence id`` is fresh per commit and recorded in the
  manifest (``"fence"``). Holds ``commit`` or ``revoked``: created by the
  committer or by a deleter, whoever is first. A fenced manifest counts as
  committed only once its fence says ``commit``. It goes with its step.

The committer (:meth:`ckptio.store.CheckpointStore.commit`, :mod:`ckptio.store.commit`):

1. checks that every object its manifest names is there;
2. creates the manifest (the manifest names the fence id);
3. lists the revocations of the step: if one names a save whose objects the
   manifest lists, it claims the fence as ``revoked``, removes its manifest
   and fails the save;
4. claims the fence as ``commit``; if a deleter claimed it first, as (3);
5. reads its manifest back: if it is gone (a deleter revoked the commit,
   deleted the step and its fence, and only then did the claim in (4) land),
   the save fails.

A deleter, before deleting objects of a save it judged dead:

1. creates the save's revocation;
2. reads the step's manifest: if one names that save and its fence is not
   yet claimed, claims it as ``revoked``; if the fence says ``commit``, the
   save committed before the revocation and its objects are kept.

Why no interleaving loses data: a committer that listed no revocation in (3)
created its manifest before the deleter's revocation, so the deleter's read
in (2) sees that manifest and contests the fence; the fence has one creator,
so either the commit stands (and the deleter keeps the objects) or the
revocation does (and the committer fails, and readers never see the
manifest as committed). A committer that listed the revocation fails on its
own. A paused process can delay any step, not reorder them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ckptio.backends import Backend
from ckptio.engine import gather_or_cancel
from ckptio.errors import IntegrityError
from ckptio.manifest.names import fence_key, parse_object, parse_revoked, revoked_key, revoked_prefix

__all__ = ["COMMIT", "REVOKED", "Fences", "writers_of"]

log = logging.getLogger("ckptio.fence")

#: A fence's two outcomes.
COMMIT = b"commit"
REVOKED = b"revoked"


def writers_of(keys: Iterable[str], naming: object = None) -> set[str]:
    """The save ids whose objects (or fragments) ``keys`` name (``naming``: see :func:`ckptio.manifest.names.parse_object`)."""
    return {n.save_id for k in keys if (n := parse_object(k, naming)) is not None}


class Fences:
    """Revocations and fences of one store.

    ``backend`` retries its own calls (the store's :class:`~ckptio.backends.wrappers.RetryingBackend`);
    ``concurrency``: how many revocations are created at once (twice this).
    """

    def __init__(self, backend: Backend, concurrency: int) -> None:
        self.backend = backend
        self.concurrency = concurrency

    async def revoke(self, step_dir: str, save_ids: Iterable[str]) -> None:
        """Revoke ``save_ids`` in ``step_dir``: none of them may commit from now on."""

        async def one(sid: str) -> None:
            key = revoked_key(step_dir, sid)
            try:
                await self.backend.create_if_absent(key, b"")
            except FileExistsError:
                pass  # revoked already: revocations are never undone

        await gather_or_cancel((one(s) for s in sorted(set(save_ids))), limit=self.concurrency * 2)

    async def revoked(self, step_dir: str) -> set[str]:
        """The save ids revoked in ``step_dir``."""
        prefix = revoked_prefix(step_dir)
        listed = await self.backend.list(prefix)
        return {n.save_id for i in listed if (n := parse_revoked(i.key)) is not None and n.step_dir == step_dir}

    async def outcome(self, step_dir: str, fence_id: str) -> bytes | None:
        """What the fence ``fence_id`` says (:data:`COMMIT` or :data:`REVOKED`); None if unclaimed."""
        key = fence_key(step_dir, fence_id)
        try:
            for _ in range(2):  # corrupted in flight? one more read tells
                got = bytes(await self.backend.read(key))
                if got in (COMMIT, REVOKED):
                    return got
        except FileNotFoundError:
            return None
        raise IntegrityError(f"fence {key!r} holds {got[:16]!r}, neither {COMMIT!r} nor {REVOKED!r}", key=key)

    async def claim(self, step_dir: str, fence_id: str, outcome: bytes) -> bytes:
        """Claim fence ``fence_id`` with ``outcome``; returns the outcome that stands (the first claim's).

        A retried create may meet its own first attempt (which won but lost its reply): the
        stored outcome is then ours, which is what is returned.
        """
        key = fence_key(step_dir, fence_id)
        try:
            await self.backend.create_if_absent(key, outcome)
            return outcome
        except FileExistsError:
            pass
        stood = await self.outcome(step_dir, fence_id)
        if stood is None:  # created then deleted: only deletion of the whole step removes a fence
            raise FileNotFoundError(f"{key!r} vanished while being claimed (the step is being deleted)")
        return stood
