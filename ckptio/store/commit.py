"""Committing a checkpoint: one manifest, created once, atomically, after its objects; fenced.

The commit is the only write that makes a checkpoint exist. It checks every
object the manifest names, creates the manifest (create-if-absent), then
confirms it through its fence (:mod:`ckptio.store.fence`, steps 3-5): a save that
stalled past its lease and was revoked rolls its commit back instead.
"""

from __future__ import annotations

import dataclasses
import logging

from ckptio.backends.base import join_key
from ckptio.engine import gather_or_cancel
from ckptio.errors import (
    CheckpointNotFoundError, IntegrityError, ManifestError, SaveRevokedError, StepBusyError,
    UnconfirmedCommitError,
)
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.manifest.names import fence_key, new_id
from ckptio.store.context import StoreContext
from ckptio.store.deletion import Deletion
from ckptio.store.fence import COMMIT, REVOKED, Fences
from ckptio.store.manifests import Manifests, check_binding
from ckptio.store.objects import Objects

__all__ = ["Commits"]

log = logging.getLogger("ckptio.store")


class Commits:
    """Commits of one store, and the checks before a save of a step."""

    def __init__(
        self, ctx: StoreContext, manifests: Manifests, objects: Objects, fences: Fences, deletion: Deletion
    ) -> None:
        self.ctx = ctx
        self.manifests = manifests
        self.objects = objects
        self.fences = fences
        self.deletion = deletion

    async def commit(self, step_dir: str, manifest: Manifest, data: bytes | None = None) -> None:
        """Write the manifest once, atomically, after checking it.

        Refuses (ManifestError) a manifest not bound to ``step_dir``, and
        (FileNotFoundError / IntegrityError) one naming an object that is not
        there with its recorded size: a gc, an ``rm -rf`` or a lost write
        must fail the save, never commit a checkpoint that cannot restore.
        FileExistsError if the checkpoint exists. ``data``: the manifest's bytes when they are
        not ``manifest.to_json()`` (a format-2 root, see ckptio.manifest.fragments); they carry their own
        fence id, else (``data`` None) the commit gets a fresh one.

        The commit is fenced (:mod:`ckptio.store.fence`): after the manifest is created it stands only
        if no deleter revoked a save whose objects it names; otherwise the manifest is removed
        and SaveRevokedError raised. A reader never counts the manifest before that.
        """
        ctx = self.ctx
        where = ctx.where(step_dir)
        if data is None:  # encoded here: under a fence of this commit's own
            manifest = dataclasses.replace(manifest, fence=new_id())
        check_binding(manifest, step_dir, where)
        if not ctx.host_local:
            await self.objects.check_objects(manifest, f"commit of {where}")
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        key = join_key(step_dir, MANIFEST_NAME)
        if await ctx.exists(tomb) and not await ctx.exists(key):
            # A deletion died after removing its manifest (its objects went before it): finish it.
            await ctx.delete_keys([tomb])
        if data is None:
            data = manifest.to_json()
        try:
            await ctx.io.create_if_absent(key, data)
        except FileExistsError:
            # A retried create may meet its own first attempt, which won but lost its reply:
            # the manifest is unique to this save (id, time), so equal bytes mean we won.
            if not await self._holds(key, data):
                raise FileExistsError(f"checkpoint {where} is already committed") from None
        await self._confirm(step_dir, key, manifest, data)
        await self._remember(step_dir, key, manifest, len(data))

    async def _confirm(self, step_dir: str, key: str, manifest: Manifest, data: bytes) -> None:
        """Steps 3-5 of a fenced commit (:mod:`ckptio.store.fence`): the commit stands, or it is rolled back."""
        if not manifest.fence:
            return
        ctx = self.ctx
        # Its own id too: an incremental save that reused every shard wrote no key of its own, and a
        # deleter of a step it references revokes it by that id (ckptio.store.pins).
        revoked = await self.fences.revoked(step_dir) & (ctx.writers_of(manifest.keys()) | {manifest.checkpoint_id})
        stood = await self.fences.claim(step_dir, manifest.fence, REVOKED if revoked else COMMIT)
        if stood == COMMIT:
            if await self._still_ours(key, manifest.fence, data):
                return
            # Revoked, deleted with its step and fence, and only then did our claim land: the fence
            # we created names no manifest. Remove it; the step is not ours any more.
            await ctx.delete_keys([fence_key(step_dir, manifest.fence)])
            raise SaveRevokedError(f"commit of {ctx.where(step_dir)} rolled back: the save stalled past its "
                                   f"lease ({ctx.lease_s:g} s) and its step was deleted meanwhile")
        # Our manifest can never count (its fence says revoked): out of the way of a re-save. The
        # objects are the deleter's to remove (revoked, so no commit can name them again). Only if the
        # key still holds our bytes: the deleter may have settled the step already and a re-save
        # committed its own manifest there (#34: deleting the key unread lost that committed step).
        if await self._holds(key, data):
            await ctx.delete_keys([key])
        who = f"save {sorted(revoked)[0]}" if revoked else "this save"
        raise SaveRevokedError(
            f"commit of {ctx.where(step_dir)} rolled back: {who} stalled past its lease "
            f"({ctx.lease_s:g} s) and a deleter (gc, retention) revoked it and took its objects"
        )

    async def _holds(self, key: str, data: bytes) -> bool:
        """True if ``key`` holds exactly ``data`` (a manifest's bytes are unique to its save)."""
        try:
            return await self.ctx.io.read(key) == data
        except FileNotFoundError:
            return False

    async def _still_ours(self, key: str, fence: str, data: bytes) -> bool:
        """True if the manifest at ``key`` is the one this commit created (it names our fence)."""
        try:
            there = await self.ctx.io.read(key)
        except FileNotFoundError:
            return False
        if there == data:
            return True
        try:
            return Manifest.from_json(there, key).fence == fence
        except (ManifestError, IntegrityError):
            # Damaged in storage (or in flight): still the key we created, whose deletion would have
            # come with its fence; readers report the damage.
            log.warning("%s: the manifest just committed reads back damaged", key)
            return True

    async def _remember(self, step_dir: str, key: str, manifest: Manifest, size: int) -> None:
        """Cache the manifest just committed, as a read of it would: the retention that follows a
        save must not parse a 100k-item manifest this process just built."""
        if not step_dir:
            return  # a root checkpoint may be replaced in place: never cached
        try:
            info = await self.ctx.io.inner.stat(key)  # one try: a miss only costs a read later
        except Exception:  # noqa: BLE001 -- committed already: a cache miss only costs a read later
            return
        if info.size == size:  # ours (create_if_absent is exclusive): keyed like any read of it
            self.manifests.remember(step_dir, info.size, info.mtime, manifest)

    async def step_is_clear(self, step_dir: str) -> bool:
        """True if neither a tombstone nor a manifest is at ``step_dir``: :meth:`prepare_save` would
        do nothing there. The two stats go at once."""
        keys = (join_key(step_dir, TOMBSTONE_NAME), join_key(step_dir, MANIFEST_NAME))
        found = await gather_or_cancel(self.ctx.exists(k) for k in keys)
        return not any(found)

    async def prepare_save(self, step_dir: str) -> None:
        """Before a save of ``step_dir``: finish an interrupted deletion there; refuse a committed step.

        StepBusyError (a FileExistsError) for a manifest whose commit is not confirmed yet: whether
        its save is dead (and settled) or alive (and waited for) is :mod:`ckptio.store.resave`'s call.
        """
        ctx = self.ctx
        where = ctx.where(step_dir)
        if await ctx.exists(join_key(step_dir, TOMBSTONE_NAME)):
            log.warning("%s: an earlier deletion of this step was interrupted; finishing it before saving", where)
            await self.deletion.delete(step_dir, finishing=True)
        if await ctx.exists(join_key(step_dir, MANIFEST_NAME)):  # a stale tombstone's step keeps its own
            try:
                await self.manifests.read_root(step_dir)
            except UnconfirmedCommitError as e:
                if e.outcome != REVOKED:
                    raise StepBusyError(
                        f"checkpoint {where} has a manifest whose commit is not confirmed: a save of this "
                        "step is committing, or died mid-commit (`ckptio gc` settles it once its lease ends)",
                        manifest=e.manifest,
                    ) from None
                log.warning("%s: removing the manifest of a revoked save before saving", where)
                await self.deletion.delete(step_dir)
                return
            except (ManifestError, IntegrityError, CheckpointNotFoundError):
                pass
            raise FileExistsError(f"checkpoint {where} is already committed")
