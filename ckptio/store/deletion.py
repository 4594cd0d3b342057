"""Deleting a checkpoint, crash-safe, and only what is provably ckptio's and nobody's in flight.

Deletion first writes a tombstone (``ckptio.deleting``, holding the id of
the checkpoint it deletes) so no reader picks a checkpoint whose objects are
going away, then the files the manifest proves it wrote for other tools
(:mod:`ckptio.store.companions`), then the objects the manifest lists and those of dead
attempts at the same step, the manifest, and the tombstone last. A save of a
step with a leftover tombstone finishes that deletion first.

Before it deletes an object of a save that did not commit, a deleter revokes
that save (:mod:`ckptio.store.fence`): if it is only paused, it can never commit
what is being taken.
"""

from __future__ import annotations

import logging

from ckptio.backends.base import ObjectInfo, join_key
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.manifest.names import (
    fence_key,
    parse_fence,
    parse_held,  # hosts' commit records (ckptio.tiers.held): see _doomed
    parse_intent,
    step_of_key,
)
from ckptio.store.companions import delete_companions
from ckptio.store.context import StoreContext
from ckptio.store.fence import COMMIT, REVOKED, Fences
from ckptio.store.intents import Intents
from ckptio.store.manifests import Manifests
from ckptio.store.parts import PartRecord, Parts
from ckptio.store.pins import Pins, pin_key
from ckptio.store.unchanged import delete_unchanged, read_versioned, version_of

__all__ = ["Deletion"]

log = logging.getLogger("ckptio.store")

#: Rounds of "version, re-read, delete that version" before a deletion leaves a manifest that keeps
#: changing under it to whoever is changing it.
_MANIFEST_ATTEMPTS = 4


class Deletion:
    """Deletion of one store's checkpoints, and the revocations that must come first."""

    def __init__(self, ctx: StoreContext, manifests: Manifests, intents: Intents, fences: Fences,
                 parts: Parts) -> None:
        self.ctx = ctx
        self.parts = parts
        self.manifests = manifests
        self.intents = intents
        self.fences = fences
        #: Saves referencing this store's steps (incremental saves, docs/incremental.md).
        self.pins = Pins(ctx.io, fences, manifests.read_unchecked, intents.live_saves, self.settle_fence,
                         self._fragment_objects)

    async def delete(self, step_dir: str, *, finishing: bool = False) -> None:
        """Delete a checkpoint: tombstone, objects, dead attempts, records, manifest, fences, tombstone
        (crash-safe order).

        Deletes only keys of ``step_dir``'s own layout that :mod:`ckptio.manifest.names`
        proves are ckptio's, never an object of a live save, and never
        anything a manifest lists outside the step (a copied step directory). In a host-local
        store a step may be committed by a host's record instead of a manifest
        (:mod:`ckptio.store.parts`): the part whose record stood when the deletion began goes; a
        part committed at the step after that (a re-save, under a paused deleter) stays.

        ``finishing``: only finish the deletion a tombstone announces (gc, a save meeting one). A
        tombstone naming another checkpoint than the one whose commit stands there now is a paused
        deleter's, written after that checkpoint's delete-and-re-save: it is removed, the checkpoint kept.
        """
        ctx = self.ctx
        where = ctx.where(step_dir)
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        manifest, unreadable = await self._read_root(step_dir)
        committed = manifest is not None and await self.settle_fence(step_dir, manifest)
        if finishing and committed and await self._stale(tomb, manifest, where):  # type: ignore[arg-type]
            return
        parts = await self._settled_parts(step_dir)  # the parts this deletion takes: standing now
        targets = {r.checkpoint_id for r in parts}
        marker = (manifest.checkpoint_id if manifest is not None else min(targets, default="")).encode()
        fence_id = manifest.fence if manifest is not None else None
        finished = ctx.writers_of(manifest.keys()) if committed and manifest is not None else set()
        finished |= ctx.writers_of(k for r in parts for k in r.objects)
        root = manifest
        manifest = await self._with_fragments(step_dir, manifest)
        created = True
        try:
            await ctx.io.create_if_absent(tomb, marker)
        except FileExistsError:
            created = False  # an earlier deletion was interrupted: finish it
        everywhere = manifest is None or await self.intents.others_than(step_dir, ctx.writers_of(manifest.keys()))
        listing = await ctx.step_listing(step_dir, everywhere=everywhere)
        live = await self.intents.live_saves(step_dir, [i for i in listing if parse_intent(i.key)])
        keys = self._doomed(step_dir, manifest, listing, live)
        dead_pins, pinners = await self._unpinned(step_dir, keys)  # after the tombstone (docs/incremental.md, D2)
        spared, late_fences = await self._newer_parts(step_dir, listing, targets)
        # Objects a standing commit names belong to a finished save; any other writer is revoked
        # first, so that if it is only paused it can never commit them (ckptio.store.fence).
        await self.fences.revoke(step_dir, ctx.writers_of(keys) - finished - ctx.writers_of(spared))
        # A part whose record landed after the listing (its committer checked for revocations before
        # we revoked) is judged now: its fence is settled before any of its objects goes.
        more, more_fences = await self._newer_parts(step_dir, None, targets)
        spared |= more
        keys -= spared
        # The deleter's step 2 of ckptio.store.fence: a commit that stood before our revocations (a re-save
        # of the step met while we were paused) is not ours to take.
        if not await self._still_ours(step_dir, root, unreadable):
            return await self._withdraw(step_dir, marker, created)
        if root is not None:  # before the objects: torch's .metadata must never name a deleted one
            await delete_companions(ctx, step_dir, root, where)
        records = {k for k in keys if parse_held(k) is not None}
        await ctx.delete_keys(sorted(keys - records))
        await ctx.delete_keys([i.key for i in listing if (n := parse_intent(i.key)) is not None
                               and n.save_id not in live | pinners])  # holds go with their pins
        # Records after their objects, before the fences: no record outlives its objects' deletion
        # half-done and still stands.
        await ctx.delete_keys(sorted(records))
        # Read again just before: a save that finished our deletion while we were paused may have
        # committed here since (without a conditional delete this narrows the window, not closes it).
        if not await self._delete_manifest(step_dir, root, unreadable):
            return await self._withdraw(step_dir, marker, created)
        await self._unpin_bases(step_dir, root)
        # Fences go after the manifest (a paused committer whose claim lands later finds its manifest
        # gone and fails: ckptio.store.fence, step 5).
        fences = {i.key for i in listing if (n := parse_fence(i.key)) is not None and n.step_dir == step_dir}
        fences |= late_fences | more_fences | {fence_key(step_dir, r.fence) for r in parts}
        if fence_id:
            fences.add(fence_key(step_dir, fence_id))
        await ctx.delete_keys(sorted(fences - spared))
        await ctx.delete_keys([tomb])
        await self.pins.unpin(dead_pins)  # revoked, never committed: they can never matter again
        self.manifests.forget(step_dir)
        log.info("deleted checkpoint %s (%d objects)", where, len(keys))

    async def _unpin_bases(self, step_dir: str, root: Manifest | None) -> None:
        """Once the step's manifest is deleted, the pins its save made on older steps (after it: while
        the manifest may count, its references must hold; docs/incremental.md, R4)."""
        if root is not None and root.bases:
            # Many hosts: each host pinned under its own save id, which its fragment's key names.
            savers = {root.checkpoint_id} | self.ctx.writers_of(f.key for f in root.fragments or [])
            await self.pins.unpin(pin_key(b, step_dir, x) for b in root.bases for x in savers)

    async def _fragment_objects(self, step_dir: str, root: Manifest, number: int) -> list[str]:
        """The object keys fragment ``number`` of the format-2 ``root`` at ``step_dir`` names (its shards unread)."""
        return (await self.manifests.load_fragment_numbers(step_dir, root, [number], names=())).objects

    async def _unpinned(self, step_dir: str, keys: set[str]) -> tuple[list[str], set[str]]:
        """Take out of ``keys`` what later steps' saves reference through their pins on ``step_dir``
        (all of its objects while one of them is alive); returns the pins found dead, and the save
        ids of all pins seen (their holds stay: they go with their pins)."""
        if not step_dir:
            return [], set()
        pinned = await self.pins.judge(step_dir)
        keys -= {k for k in keys if self.ctx.parse_object(k)} if pinned.keep_all else pinned.keep
        return pinned.dead, pinned.pinners

    async def _read_root(self, step_dir: str) -> tuple[Manifest | None, bool]:
        """The step's manifest as stored (None if absent or unreadable), and whether it is unreadable."""
        try:
            return await self.manifests.read_unchecked(step_dir), False
        except FileNotFoundError:
            return None, False
        except (ManifestError, IntegrityError, RecursionError) as e:
            log.warning("deleting %s: its manifest is unreadable (%s); deleting by name only",
                        self.ctx.where(step_dir), e)
            return None, True

    async def _stale(self, tomb: str, standing: Manifest, where: str) -> bool:
        """Whether the tombstone at ``tomb`` announces the deletion of another checkpoint than
        ``standing`` (whose commit stands), or is gone: then there is nothing to finish. A stale one is
        removed (its deleter, if only paused, withdraws on waking: it re-reads before deleting)."""
        try:
            marker, version = await read_versioned(self.ctx.io, tomb)
        except FileNotFoundError:
            return True
        if not marker or marker == standing.checkpoint_id.encode():
            return False
        if not await delete_unchanged(self.ctx.io, tomb, version):
            return True  # replaced since it was read: a live deleter's, not the stale one judged here
        log.warning("%s: a tombstone names checkpoint %r, but %r is committed there; the tombstone is "
                    "a paused deleter's, written after a delete and re-save of the step: removed, "
                    "the checkpoint kept", where, marker.decode(errors="replace"), standing.checkpoint_id)
        return True

    async def _still_ours(self, step_dir: str, root: Manifest | None, unreadable: bool) -> bool:
        """Whether the manifest at ``step_dir`` now is still the one this deletion set out to take.

        No manifest, or ``root``'s checkpoint: yes. Another checkpoint's: yes only if its commit does
        not stand (an unclaimed fence is claimed "revoked" here, so it never will). One that cannot be
        read: yes only if the deletion began on an unreadable one (it deletes by name)."""
        try:
            now = await self.manifests.read_unchecked(step_dir)
        except FileNotFoundError:
            return True
        except (ManifestError, IntegrityError, RecursionError):
            return unreadable and root is None
        if root is not None and now.checkpoint_id == root.checkpoint_id:
            return True
        return not await self.settle_fence(step_dir, now)

    async def _delete_manifest(self, step_dir: str, root: Manifest | None, unreadable: bool) -> bool:
        """Delete the step's manifest if it is still one :meth:`_still_ours` accepts; False (nothing
        deleted) if a newer commit holds the step.

        With a conditional delete the manifest's version is taken before that re-read and only that
        version is deleted: a commit landing after the re-read (a paused deleter) is never taken.
        Without one, such a commit is taken if it lands inside the one request between the two."""
        key = join_key(step_dir, MANIFEST_NAME)
        io = self.ctx.io
        for _ in range(_MANIFEST_ATTEMPTS):
            version = await version_of(io, key)
            if not await self._still_ours(step_dir, root, unreadable):
                return False
            if version is None:  # none before the re-read: none to delete, unless one came since
                if await version_of(io, key) is None:
                    return True
            elif await delete_unchanged(io, key, version):
                return True
        log.warning("deleting %s: its manifest kept changing under the deletion; the one there stays",
                    self.ctx.where(step_dir))
        return False

    async def _withdraw(self, step_dir: str, marker: bytes, created: bool) -> None:
        """Leave a step a newer commit holds: remove the tombstone this deletion wrote (only that)."""
        log.warning("deleting %s: a newer checkpoint was committed there meanwhile; it is kept",
                    self.ctx.where(step_dir))
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        if created:
            try:
                held, version = await read_versioned(self.ctx.io, tomb)
                if held == marker:  # with a conditional delete, only if it is still the one read
                    await delete_unchanged(self.ctx.io, tomb, version)
            except FileNotFoundError:
                pass
        self.manifests.forget(step_dir)

    async def _settled_parts(self, step_dir: str) -> list[PartRecord]:
        """The records of ``step_dir`` whose commit stands, each unclaimed fence claimed "revoked" first.

        Only a host-local store's records commit anything (elsewhere they go by name): no listing there."""
        if not step_dir or not self.ctx.host_local:
            return []
        records, _bad = await self.parts.read(step_dir)
        return [r for r in records if await self.parts.settle(step_dir, r)]

    async def _newer_parts(self, step_dir: str, listing: list[ObjectInfo] | None, targets: set[str]
                           ) -> tuple[set[str], set[str]]:
        """What a part committed at ``step_dir`` since this deletion began keeps (its record, fence and
        objects), and the fences of the parts this settles "revoked" (they go with the step).

        Each record not of ``targets`` is settled: a committer paused before its claim is revoked; one
        whose claim stood first keeps its part (a re-save of the step, met by a paused deleter)."""
        if not step_dir or not self.ctx.host_local:
            return set(), set()
        records, _bad = await self.parts.read(step_dir, listing)
        spared: set[str] = set()
        revoked: set[str] = set()
        for r in records:
            if r.checkpoint_id in targets:
                continue
            if await self.parts.settle(step_dir, r):
                log.warning("deleting %s: a part of checkpoint %s committed meanwhile; it stays",
                            self.ctx.where(step_dir), r.checkpoint_id)
                spared |= {r.key, fence_key(step_dir, r.fence), *r.objects}
            else:
                revoked.add(fence_key(step_dir, r.fence))
        return spared, revoked

    async def _with_fragments(self, step_dir: str, manifest: Manifest | None) -> Manifest | None:
        """A format-2 ``manifest`` with its fragments (which name its objects); None if one is unreadable:
        the root alone names no data objects, so they are found by name, under every prefix."""
        if manifest is None:
            return None
        try:
            return await self.manifests.load_fragments(step_dir, manifest, None)
        except (ManifestError, IntegrityError) as e:
            log.warning("deleting %s: a fragment is unreadable (%s); deleting by name only",
                        self.ctx.where(step_dir), e)
            return None

    def _doomed(
        self, step_dir: str, manifest: Manifest | None, listing: list[ObjectInfo], live: set[str]
    ) -> set[str]:
        """The objects of ``step_dir`` to delete: those its manifest names inside the step, those
        listed there that are provably ckptio's and of no live save, and its hosts' commit records."""
        owned = manifest.keys() if manifest is not None else []
        keys = {k for k in owned if step_of_key(k) == step_dir}
        foreign = len([k for k in owned if step_of_key(k) not in (manifest.bases or {})]) - len(keys)  # type: ignore[union-attr]
        if foreign > 0:  # a base's objects (incremental) are its own step's to delete
            log.warning("deleting %s: its manifest names %d objects outside the step; left alone",
                        self.ctx.where(step_dir), foreign)
        for info in listing:
            name = self.ctx.parse_object(info.key)
            if name is not None and name.step_dir == step_dir and name.save_id not in live:
                keys.add(info.key)
            elif (held := parse_held(info.key)) is not None and held.step_dir == step_dir:
                # A host's commit record (ckptio.tiers.held) goes before the manifest it vouches for:
                # no record outlives its commit, so none can speak for a later one at this step.
                keys.add(info.key)
        return keys

    async def settle_fence(self, step_dir: str, manifest: Manifest) -> bool:
        """True if ``manifest``'s commit stands; an unclaimed fence is claimed "revoked" first, so a
        committer paused before confirming can never make what is being deleted count."""
        if not manifest.fence:
            return True
        outcome = await self.fences.outcome(step_dir, manifest.fence)
        if outcome is None:
            outcome = await self.fences.claim(step_dir, manifest.fence, REVOKED)
        return outcome == COMMIT

    async def revoke_before_deleting(self, step_dir: str, infos: list[ObjectInfo]) -> list[ObjectInfo]:
        """Revoke the saves that wrote ``infos`` (dead or paused), then return those that may go.

        A commit may have created its manifest (or, host-local, a host its record) since the listing:
        if it names one of these saves, its fence decides (claimed "revoked" here if still open).
        Objects of a commit that stands are kept; so is everything in a step whose manifest (or a
        record) appeared but cannot be read.
        """
        sids = self.ctx.writers_of(i.key for i in infos)
        await self.fences.revoke(step_dir, sids)
        kept: set[str] = set()
        records, bad = await self.parts.read(step_dir) if step_dir and self.ctx.host_local else ([], [])
        if bad:
            log.warning("gc %s: unreadable commit records in step %r; its objects are kept", self.ctx.url, step_dir)
            return []
        for r in records:
            named = self.ctx.writers_of(r.objects) & sids
            if named and await self.parts.settle(step_dir, r):
                kept |= named
        try:
            m = await self.manifests.read_unchecked(step_dir)
        except FileNotFoundError:
            m = None
        except (ManifestError, IntegrityError) as e:
            log.warning("gc %s: a manifest appeared in step %r and cannot be read; its objects are kept: %s",
                        self.ctx.url, step_dir, e)
            return []
        if m is not None:
            named = self.ctx.writers_of(m.keys()) & sids
            if named and await self.settle_fence(step_dir, m):
                kept |= named
        return [i for i in infos if self.ctx.parse_object(i.key).save_id not in kept]  # type: ignore[union-attr]
