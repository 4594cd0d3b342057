"""The orphan sweep: what crashed, killed or revoked saves left, deleted by the rules of ownership.

An object goes only if its key is one ckptio writes (:mod:`ckptio.manifest.names`, or
the store's naming), it is older than the grace period, no live save
announced it (whatever its age), no manifest that counts names it, and its
step's manifest is not damaged (a damaged step's objects are kept for
inspection). Its writer is revoked first (:mod:`ckptio.store.fence`). The sweep
also finishes interrupted deletions, settles dead commits (a manifest whose
fence never said "commit" and whose writers' leases ended), removes dead
saves' intents and stray fences, and the temporaries of killed writes.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ckptio.backends import Backend
from ckptio.backends.base import ObjectInfo, join_key
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError, UnconfirmedCommitError
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.manifest.names import ObjectName, fence_key, parse_fence, parse_held, parse_intent
from ckptio.store.context import StoreContext
from ckptio.store.deletion import Deletion
from ckptio.store.fence import Fences
from ckptio.store.intents import Intents
from ckptio.store.manifests import Manifests
from ckptio.store.options import check_grace, step_dir_of
from ckptio.store.pins import parse_pin

__all__ = ["Collector", "SweepReport", "sweeps_temporaries_by_prefix"]

log = logging.getLogger("ckptio.store")


@dataclasses.dataclass
class SweepReport:
    """What one sweep deleted (or would, with ``dry_run``)."""

    objects: list[str] = dataclasses.field(default_factory=list)
    temporaries: list[str] = dataclasses.field(default_factory=list)
    intents: list[str] = dataclasses.field(default_factory=list)
    finished_deletions: list[int | None] = dataclasses.field(default_factory=list)
    #: Objects spared because a live save announced them (whatever their age).
    spared_in_flight: int = 0
    #: Step directories whose objects were spared because their manifest is damaged.
    damaged: list[str] = dataclasses.field(default_factory=list)
    bytes: int = 0

    @property
    def deleted(self) -> list[str]:
        return self.objects + self.temporaries + self.intents


@dataclasses.dataclass
class _Round:
    """One sweep's shared state: its listing by step, and what its steps turned out to be."""

    by_step: dict[str, list[ObjectInfo]]
    markers: set[str]  # the manifests and tombstones listed
    now: float  # the time before the listing
    grace: float
    dry_run: bool
    report: SweepReport
    keep: set[str] = dataclasses.field(default_factory=set)  # keys a manifest that counts names
    protected: set[str] = dataclasses.field(default_factory=set)  # step dirs whose objects nobody may sweep now
    unconfirmed: dict[str, Manifest] = dataclasses.field(default_factory=dict)  # fence not "commit"
    live: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # live save ids by step


def sweeps_temporaries_by_prefix(backend: Backend) -> bool:
    """True if ``backend.sweep_temporaries`` takes a ``prefix`` (sweeps one step's temporaries only).

    The Backend ABC's sweep walks the whole root; a backend (or wrapper) that can
    limit it to a prefix declares so (:attr:`Capabilities.sweeps_by_prefix`).
    """
    return backend.capabilities.sweeps_by_prefix


class Collector:
    """The orphan sweep of one store, whole (:meth:`sweep`) or for one step (:meth:`sweep_step`)."""

    def __init__(
        self, ctx: StoreContext, manifests: Manifests, intents: Intents, fences: Fences, deletion: Deletion
    ) -> None:
        self.ctx = ctx
        self.manifests = manifests
        self.intents = intents
        self.fences = fences
        self.deletion = deletion

    def _name(self, key: str) -> ObjectName | None:
        """What an object's, intent's, fence's or commit record's key says (for a record, its checkpoint
        id as the id); None for a key that is none of ckptio's."""
        name = self.ctx.parse_object(key) or parse_intent(key) or parse_fence(key)
        if name is None and (held := parse_held(key)) is not None:
            name = ObjectName(held.step_dir, held.checkpoint_id)
        return name

    async def sweep(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> SweepReport:
        """Delete what crashed saves left: ckptio's objects that no intact manifest names.

        An object goes only if its key is one ckptio writes (:mod:`ckptio.manifest.names`),
        it is older than ``grace_seconds``, no live save announced it (whatever
        its age), and its step's manifest is not damaged (a damaged step's
        objects are kept for inspection). Also finishes interrupted deletions,
        removes dead saves' intents, and the temporary files of killed writes
        (:meth:`Backend.sweep_temporaries`). Never raises for one bad step.
        """
        grace_seconds = check_grace(grace_seconds)
        report = SweepReport()
        now = time.time()
        report.temporaries = await self.ctx.io.sweep_temporaries(self._temporary_grace(grace_seconds),
                                                                 dry_run=dry_run)
        listing = await self.ctx.io.list("")
        by_step: dict[str, list[ObjectInfo]] = {}
        for info in listing:
            name = self._name(info.key)
            if name is not None:
                by_step.setdefault(name.step_dir, []).append(info)
        markers = {i.key for i in listing if i.key.rpartition("/")[2] in (MANIFEST_NAME, TOMBSTONE_NAME)}
        for key in markers:  # a step whose deletion died after its objects went holds markers only
            parent = key.rpartition("/")[0]
            if parent == "" or (parent.isdigit() and str(int(parent)) == parent):
                by_step.setdefault(parent, [])
        await self._sweep_steps(_Round(by_step, markers, now, grace_seconds, dry_run, report))
        pins = [p for i in listing if (p := parse_pin(i.key)) is not None]
        if pins and not dry_run:  # dead pins on steps that still stand (a killed incremental save's)
            for base in sorted({p.base for p in pins}, key=int):
                await self.deletion.pins.unpin((await self.deletion.pins.judge(base)).dead)
        return report

    async def sweep_step(self, step: int, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> SweepReport:
        """:meth:`sweep` for one step only: what crashed or killed saves of ``step`` left.

        The same rules, deleting only keys of ``step``'s own layout (its directory, and
        ``<h>/<step>/`` under each hashed prefix); never lists the whole root, never touches
        another step. Temporary files of killed writes go only where the backend can find
        them under the step (``sweep_temporaries(..., prefix=...)``), and only while no
        live save is announced in the step: a temporary cannot say whose write it is.
        ``step`` must be an int (else ValueError): a step-less checkpoint shares the root with
        everything, sweep it with :meth:`sweep`.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"sweep_step needs an int step, got {step!r}: a checkpoint saved at the root "
                             "is swept by sweep()")
        step_dir = step_dir_of(step)
        grace_seconds = check_grace(grace_seconds)
        report = SweepReport()
        now = time.time()
        listing = await self.ctx.step_listing(step_dir, everywhere=True)
        infos = [i for i in listing if (n := self._name(i.key)) is not None and n.step_dir == step_dir]
        markers = {i.key for i in listing if i.key in (join_key(step_dir, MANIFEST_NAME),
                                                       join_key(step_dir, TOMBSTONE_NAME))}
        rnd = _Round({step_dir: infos}, markers, now, grace_seconds, dry_run, report)
        await self._sweep_steps(rnd)
        if not rnd.live[step_dir] and step_dir not in rnd.protected:
            report.temporaries = await self._step_temporaries(step_dir, grace_seconds, dry_run)
        return report

    async def _step_temporaries(self, step_dir: str, grace_seconds: float, dry_run: bool) -> list[str]:
        """The temporaries under ``step_dir`` older than ``grace_seconds``, swept; none where the
        backend can only sweep its whole root (that is :meth:`sweep`'s job, not one step's)."""
        if not sweeps_temporaries_by_prefix(self.ctx.backend):
            log.debug("%s: the backend sweeps temporaries root-wide only; left to gc", self.ctx.where(step_dir))
            return []
        sweep = self.ctx.io.sweep_temporaries  # a RetryingBackend: passes ``prefix`` on
        return await sweep(self._temporary_grace(grace_seconds), dry_run=dry_run,  # type: ignore[call-arg]
                           prefix=step_dir + "/")

    def _temporary_grace(self, grace_seconds: float) -> float:
        """A temporary cannot say whose write it is, so it goes only once a lease has passed
        since its last byte: a write in flight keeps its mtime fresh, and a grace of 0 (``gc
        --grace 0``) must not pull the file from under a live save's write."""
        return max(grace_seconds, self.ctx.lease_s)

    async def _sweep_steps(self, rnd: _Round) -> None:
        """The sweep of the steps in ``rnd.by_step``, into ``rnd.report``; fills ``rnd.live`` (the live
        save ids of each step) and ``rnd.protected`` (steps left alone: a deletion finished, a damaged
        manifest, or one changing under us)."""
        await self._read_markers(rnd)
        for step_dir, infos in rnd.by_step.items():
            rnd.live[step_dir] = await self.intents.live_saves(step_dir, [i for i in infos if parse_intent(i.key)])
        dead = await self._dead_commits(rnd)
        await self._doom_objects(rnd)
        report = rnd.report
        intents = [i for infos in rnd.by_step.values() for i in infos if (n := parse_intent(i.key)) is not None
                   and n.step_dir not in rnd.protected and n.save_id not in rnd.live[n.step_dir]
                   and rnd.now - i.mtime >= rnd.grace]
        report.intents = [i.key for i in await self._without_holds(intents)]
        stale, stale_fences = await self._stale_records(rnd)
        report.objects += stale
        if not rnd.dry_run:
            await self.ctx.delete_keys(report.objects)
            await self.ctx.delete_keys(report.intents)
        # A revoked commit's manifest goes after the objects it names: it never counted anyway. Only
        # while it is still there: another deleter (a re-save's settling, #34) may have taken it
        # meanwhile and a new save committed its own manifest at the same key.
        manifests = [join_key(d, MANIFEST_NAME) for d in dead if await self._still_named(d, rnd.unconfirmed[d])]
        fences = [fence_key(d, f) for d in dead if (f := rnd.unconfirmed[d].fence)]
        stray = sorted(set(await self._stray_fences(rnd, set(dead))) | set(stale_fences))
        report.objects += manifests + fences + stray
        if not rnd.dry_run:
            await self.ctx.delete_keys(stray)
            await self.ctx.delete_keys(manifests)
            await self.ctx.delete_keys(fences)  # fences after manifests (ckptio.store.fence, step 5)
        report.objects.sort()

    async def _without_holds(self, intents: list[ObjectInfo]) -> list[ObjectInfo]:
        """``intents`` less the holds whose pins stand (ckptio.store.pins: a hold goes with its
        pin, which is created first, so a hold listed before this pins' listing finds its pin)."""
        pinners: dict[str, set[str]] = {}
        for step_dir in sorted({n.step_dir for i in intents if (n := parse_intent(i.key)) is not None and n.step_dir}):
            pinners[step_dir] = {p.save_id for p in await self.deletion.pins.of(step_dir)}
        return [i for i in intents if (n := parse_intent(i.key)) is None
                or n.save_id not in pinners.get(n.step_dir, set())]

    async def _read_markers(self, rnd: _Round) -> None:
        """Finish the deletions tombstones announce; read each listed manifest: what a committed one
        names is kept, an unconfirmed one is judged by :meth:`_dead_commits`, a damaged one protects
        its step."""
        for step_dir in sorted(rnd.by_step, key=lambda s: (len(s), s)):
            if join_key(step_dir, TOMBSTONE_NAME) in rnd.markers:
                if not rnd.dry_run:
                    await self.deletion.delete(step_dir, finishing=True)
                rnd.report.finished_deletions.append(int(step_dir) if step_dir else None)
                rnd.protected.add(step_dir)
                continue
            if not await self._keep_parts(rnd, step_dir):
                continue
            if join_key(step_dir, MANIFEST_NAME) not in rnd.markers:
                continue
            try:
                kept = await self.manifests.read_manifest(step_dir)
                rnd.keep.update(kept.keys())
                if kept.fence:
                    rnd.keep.add(fence_key(step_dir, kept.fence))
            except UnconfirmedCommitError as e:
                rnd.unconfirmed[step_dir] = e.manifest  # type: ignore[assignment]
            except CheckpointNotFoundError:
                rnd.protected.add(step_dir)  # changing under us: leave it to the next sweep
            except (ManifestError, IntegrityError) as e:
                log.warning("gc %s: step %r is damaged, its objects are kept: %s", self.ctx.url, step_dir, e)
                rnd.report.damaged.append(step_dir)
                rnd.protected.add(step_dir)

    async def _keep_parts(self, rnd: _Round, step_dir: str) -> bool:
        """Keep what each standing commit record of ``step_dir`` names, its fence and itself; False (the
        step protected) when a record cannot be read: it may be the only proof of a committed part."""
        listed = [i for i in rnd.by_step[step_dir] if (h := parse_held(i.key)) is not None and h.step_dir == step_dir]
        if not listed or not step_dir:
            return True
        records, bad = await self.deletion.parts.read(step_dir, listed)
        if bad:
            log.warning("gc %s: step %r has unreadable commit records, its objects are kept", self.ctx.url, step_dir)
            rnd.report.damaged.append(step_dir)
            rnd.protected.add(step_dir)
            return False
        for r in records:
            if await self.deletion.parts.stands(step_dir, r):
                rnd.keep.update([*r.objects, r.key, fence_key(step_dir, r.fence)])
        return True

    async def _doom_objects(self, rnd: _Round) -> None:
        """Report (and revoke the writers of) the objects old enough, of no live save, that nothing
        keeps; a save that announced itself since the listing keeps its objects."""
        doomed: dict[str, list[ObjectInfo]] = {}
        for step_dir, infos in rnd.by_step.items():
            if step_dir in rnd.protected:
                continue
            for info in infos:
                name = self.ctx.parse_object(info.key)
                if name is None or info.key in rnd.keep:
                    continue
                if name.save_id in rnd.live[step_dir]:
                    rnd.report.spared_in_flight += 1
                elif rnd.now - info.mtime >= rnd.grace:
                    doomed.setdefault(step_dir, []).append(info)
        for step_dir, infos in doomed.items():
            again = await self.intents.live_saves(step_dir)
            gone = [i for i in infos if self.ctx.parse_object(i.key).save_id not in again]  # type: ignore[union-attr]
            gone = await self._unpinned(step_dir, gone, rnd.dry_run)
            if gone and not rnd.dry_run:
                gone = await self.deletion.revoke_before_deleting(step_dir, gone)
            rnd.report.objects += [i.key for i in gone]
            rnd.report.bytes += sum(i.size for i in gone)

    async def _unpinned(self, step_dir: str, infos: list[ObjectInfo], dry_run: bool) -> list[ObjectInfo]:
        """``infos`` less what later steps' saves reference through their pins on ``step_dir``
        (docs/incremental.md: a live one keeps them all). A dry run judges nothing (judging revokes
        dead saves): a step with any pin keeps all."""
        if not infos or not step_dir:
            return infos
        pins = self.deletion.pins
        if dry_run:
            return [] if await pins.of(step_dir) else infos
        judged = await pins.judge(step_dir)
        if judged.keep_all:
            return []
        await pins.unpin(judged.dead)
        return [i for i in infos if i.key not in judged.keep]

    async def _stale_records(self, rnd: _Round) -> tuple[list[str], list[str]]:
        """Hosts' commit records (:mod:`ckptio.store.parts`) older than the grace whose fence does not
        stand: a record is written before its fence is claimed, so one whose fence says "revoked" (or
        whose claim never came, now claimed "revoked" here) can never count, and names nothing anyone
        keeps. A standing record (in ``rnd.keep``) is the commit of its host's part. Returns the records
        and the fences they name (to go after them)."""
        out: list[str] = []
        fences: list[str] = []
        for step_dir, infos in rnd.by_step.items():
            if step_dir in rnd.protected:
                continue
            old = [i for i in infos if (h := parse_held(i.key)) is not None and h.step_dir == step_dir
                   and i.key not in rnd.keep and rnd.now - i.mtime >= rnd.grace]
            if not old:
                continue
            records, _bad = await self.deletion.parts.read(step_dir, old)
            for r in records:
                if self.ctx.writers_of(r.objects) & rnd.live.get(step_dir, set()):
                    continue  # its save is alive (a commit in flight): never revoked by gc
                if rnd.dry_run or not await self.deletion.parts.settle(step_dir, r):
                    out.append(r.key)
                    fences.append(fence_key(step_dir, r.fence))
        return out, fences

    async def _still_named(self, step_dir: str, m: Manifest) -> bool:
        """True if ``step_dir``'s manifest is still ``m`` (the same commit: its id and fence)."""
        try:
            there = await self.manifests.read_unchecked(step_dir)
        except FileNotFoundError:
            return False
        except (ManifestError, IntegrityError):
            return False  # not provably the one judged dead: left to the next sweep
        return there.checkpoint_id == m.checkpoint_id and there.fence == m.fence

    async def _stray_fences(self, rnd: _Round, dead: set[str]) -> list[str]:
        """Fences no manifest names any more: a commit rolled back (its fence says "revoked", its
        manifest is gone) or one whose step was deleted before its claim landed. A fence is created
        after its manifest, so one that the step's current manifest does not name can never count
        again; deleting it is safe even under a paused committer (ckptio.store.fence, step 5)."""
        out: list[str] = []
        for step_dir, infos in rnd.by_step.items():
            if step_dir in rnd.protected or step_dir in dead:
                continue
            fences = [i for i in infos if parse_fence(i.key) is not None and i.key not in rnd.keep
                      and rnd.now - i.mtime >= rnd.grace]
            if not fences:
                continue
            try:  # read again: a commit may have made its manifest since the listing
                current = (await self.manifests.read_unchecked(step_dir)).fence
            except FileNotFoundError:
                current = None
            except (ManifestError, IntegrityError):
                continue  # cannot tell which fence is its: leave them all
            out += [i.key for i in fences if parse_fence(i.key).save_id != current]  # type: ignore[union-attr]
        return out

    async def _dead_commits(self, rnd: _Round) -> list[str]:
        """The steps of ``rnd.unconfirmed`` whose commit is dead: revoked, or unconfirmed with every
        writer's lease ended (they are revoked now, and their fence claimed "revoked"). A commit
        still in flight, or that turns out to stand, puts its step in ``rnd.protected``."""
        dead: list[str] = []
        for step_dir, m in rnd.unconfirmed.items():
            writers = self.ctx.writers_of(m.keys())
            if writers & rnd.live.get(step_dir, set()) or rnd.now - m.created < rnd.grace or rnd.dry_run:
                rnd.protected.add(step_dir)
                continue
            await self.fences.revoke(step_dir, writers)
            if await self.deletion.settle_fence(step_dir, m):
                rnd.protected.add(step_dir)  # it confirmed before our claim: committed after all
            else:
                dead.append(step_dir)
        return dead
