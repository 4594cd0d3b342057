"""Which steps a root holds, which count, and which one to restore.

A step counts as *committed* with a manifest and no tombstone (two stats,
nothing read), as *standing* when its fence (if any) also says "commit", and
as *intact* when its manifest validates too (and, asked ``whole``, every
object it names is there). "The latest" is the newest intact step, a damaged
newer one logged by name and skipped; a walk newest-first reads one manifest
when the newest is intact, however many steps the root keeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing

from ckptio.backends.base import join_key
from ckptio.engine import gather_or_cancel
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.store.context import StoreContext
from ckptio.store.intents import Intents
from ckptio.store.manifests import Manifests
from ckptio.store.objects import Objects
from ckptio.store.options import MAX_STEP, step_dir_of
from ckptio.store.orbax_steps import OrbaxStep, StepSource, orbax_step
from ckptio.store.parts import PartRecord, Parts
from ckptio.store.pins import PIN_DIR, parse_pin

__all__ = ["Catalog", "StepStatus"]

log = logging.getLogger("ckptio.store")

#: What reading a step's root manifest may fail with and still leave the walk going.
_EXPECTED = (CheckpointNotFoundError, ManifestError, IntegrityError, PermissionError)


@dataclasses.dataclass(frozen=True)
class StepStatus:
    """One step directory as ``ckptio ls`` shows it.

    ``state``: ``committed`` (intact), ``damaged`` (a manifest that does not
    validate or is not bound to this step, or an object or fragment it names
    is missing or short), ``unreadable`` (permission denied), ``deleting`` (tombstoned),
    ``in-flight`` (a live save's intent, no manifest), ``referenced`` (no manifest, but pins of
    incremental saves of later steps: a deleted step whose objects they reference), ``part`` (no
    manifest, but standing commit records: hosts' parts committed without the manifest, as a tiered
    job's non-coordinators and replica stores keep them, :mod:`ckptio.store.parts`; ``parts`` says
    which) or ``incomplete``
    (none of these: a crashed save's leftovers, for the sweep).

    A step directory that Orbax saved (through ``ckptio.orbax``, or stock) has no manifest
    of its own: Orbax commits it, and the sweep never touches it. Its ``state`` is Orbax's
    verdict (``committed``, ``unfinalized``, or ``damaged`` when a ckptio item in it is not
    intact), with ``orbax`` saying what its items are.
    """

    step: int | None
    state: str
    problem: str = ""
    manifest: Manifest | None = None
    orbax: OrbaxStep | None = None
    parts: tuple[PartRecord, ...] = ()


def _is_damage(found: Manifest | Exception) -> bool:
    """True for a reason that makes a step damaged (not merely uncommitted or vanished)."""
    return isinstance(found, (ManifestError, IntegrityError, PermissionError)) or (
        isinstance(found, FileNotFoundError) and not isinstance(found, CheckpointNotFoundError)
    )


class Catalog:
    """Step discovery, status and resolution of one store."""

    def __init__(self, ctx: StoreContext, manifests: Manifests, objects: Objects, intents: Intents,
                 parts: Parts) -> None:
        self.ctx = ctx
        self.parts = parts
        self.manifests = manifests
        self.objects = objects
        self.intents = intents

    async def is_committed(self, step_dir: str) -> bool:
        """A manifest is present and no deletion is under way (the manifest is not validated).

        In a host-local store, a standing commit record (:mod:`ckptio.store.parts`: a host's part
        committed without the manifest) counts as a manifest does.
        """
        manifest, tombstone = await gather_or_cancel(
            [self.ctx.exists(join_key(step_dir, MANIFEST_NAME)), self.ctx.exists(join_key(step_dir, TOMBSTONE_NAME))]
        )
        if tombstone:
            return False
        if manifest or not self.ctx.host_local or not step_dir:
            return manifest
        return bool(await self.parts.standing(step_dir))

    async def step_dirs(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending."""
        names = await self.ctx.io.list_children("")
        return sorted(int(n) for n in names if n.isdigit() and str(int(n)) == n and int(n) <= MAX_STEP)

    async def committed_steps(self) -> list[int]:
        """Steps with a manifest (host-local: or a standing commit record) and no tombstone, ascending:
        two stats a step, nothing read (a step without a manifest in a host-local store: its records).

        Neither validated nor fence-checked: a fenced manifest whose commit is still in flight (or
        died, or was revoked) is listed too. See :meth:`standing_steps` (fences) and
        :meth:`intact_roots` (fences and validation).
        """
        steps = await self.step_dirs()
        flags = await gather_or_cancel(self.is_committed(str(s)) for s in steps)
        return [s for s, ok in zip(steps, flags) if ok]

    async def standing_steps(self) -> list[int]:
        """Steps with a manifest, no tombstone and a standing commit (a fenced manifest whose fence
        does not say "commit" is a save in flight, dead or revoked: not committed), ascending.

        A damaged manifest still counts here (see :meth:`intact_roots` for the steps that
        validate). Manifests are read once and cached, fences with them.
        """
        out: list[int] = []
        async with aclosing(self.newest_first(self.ctx.concurrency)) as walk:
            async for step, found in walk:
                if not isinstance(found, CheckpointNotFoundError):
                    out.append(step)
        return sorted(out)

    async def status(self, step_dir: str, store: StepSource) -> StepStatus:
        """What ``step_dir`` holds (see :class:`StepStatus`); never raises for a bad manifest.

        ``store``: the store this catalog belongs to (an Orbax step's items are probed through it).
        """
        step = int(step_dir) if step_dir else None
        if await self.ctx.exists(join_key(step_dir, TOMBSTONE_NAME)):
            return StepStatus(step, "deleting")
        try:
            manifest = await self.manifests.read_manifest(step_dir, shards=False)
        except (ManifestError, IntegrityError) as e:
            return StepStatus(step, "damaged", problem=str(e))
        except PermissionError as e:
            return StepStatus(step, "unreadable", problem=str(e))
        except CheckpointNotFoundError:
            pass
        else:
            try:
                await self.objects.check_whole(step_dir, manifest)
            except (FileNotFoundError, IntegrityError) as e:
                return StepStatus(step, "damaged", problem=str(e), manifest=manifest)
            return StepStatus(step, "committed", manifest=manifest)
        parts = await self.parts.standing(step_dir) if step_dir else []
        if parts:
            return StepStatus(step, "part", parts=tuple(sorted(parts, key=lambda r: r.host)))
        if await self.intents.live_saves(step_dir):
            return StepStatus(step, "in-flight")
        orbax = await orbax_step(store, step_dir) if step_dir else None
        if orbax is not None:
            return StepStatus(step, orbax.state, problem=orbax.problem, orbax=orbax)
        pins = [p for i in await self.ctx.io.list(f"{PIN_DIR}/{step_dir}.") if (p := parse_pin(i.key))
                and p.base == step_dir] if step_dir else []
        if pins:  # a deleted base of incremental saves: its objects stay while later steps reference them
            later = ", ".join(sorted({p.step_dir for p in pins}, key=int))
            return StepStatus(step, "referenced", problem=f"objects held for step(s) {later}")
        return StepStatus(step, "incomplete")

    async def intact_roots(
        self, newest: int | None = None, among: Iterable[int] | None = None, *, whole: bool = False
    ) -> dict[int, Manifest]:
        """Committed steps whose manifest validates, each with its root manifest (format 2: no
        fragment read); damaged ones are logged and left out.

        With ``newest``, stop once that many intact steps (from the newest down) are found:
        "the latest step" reads one manifest, however many steps the root holds. With
        ``among``, look at those step directories only. With ``whole``, a step counts only if
        every object (format 2: every fragment) its root manifest names is there with its size
        (:meth:`Objects.check_whole`: a listing, no data read).
        """
        out: dict[int, Manifest] = {}
        async with aclosing(self.newest_first(newest or self.ctx.concurrency, among)) as walk:
            async for step, found in walk:
                if isinstance(found, Manifest) and whole:
                    try:
                        await self.objects.check_whole(str(step), found)
                    except (FileNotFoundError, IntegrityError) as e:
                        found = e
                if _is_damage(found):
                    log.warning("%s: step %d is damaged and skipped: %s", self.ctx.url, step, found)
                elif isinstance(found, Manifest):
                    out[step] = found
                    if newest is not None and len(out) >= newest:
                        break
        return out

    async def newest_first(
        self, first: int, among: Iterable[int] | None = None
    ) -> AsyncIterator[tuple[int, Manifest | Exception]]:
        """Every step directory, newest first, with its validated root manifest or the reason it
        has none: CheckpointNotFoundError (not committed, or being deleted), ManifestError /
        IntegrityError (damaged) or PermissionError (unreadable).

        Manifests are read ``first`` at a time, then the engine's concurrency at a time, so a
        caller that stops at the newest intact step costs a listing and one manifest's checks --
        not two stats of every step the root has ever kept, in the stall of every save.
        """
        steps = sorted(among if among is not None else await self.step_dirs(), reverse=True)
        i, batch = 0, max(1, first)
        while i < len(steps):
            chunk = steps[i : i + batch]
            found = await asyncio.gather(*(self.manifests.read_root(str(s), explain=False) for s in chunk),
                                         return_exceptions=True)
            for step, got in zip(chunk, found):
                if isinstance(got, BaseException) and not isinstance(got, _EXPECTED):
                    raise got
                yield step, got  # type: ignore[misc]
            i, batch = i + batch, max(batch, self.ctx.concurrency)

    async def resolve_manifest(
        self, step: int | None, skip: Iterable[int] = (), *, shards: bool = True
    ) -> tuple[str, Manifest]:
        """The step directory to restore and its manifest: ``step``'s, or the latest.

        With no step, a checkpoint saved directly at the root wins; else the newest committed
        step whose manifest validates and whose objects are there (a damaged newer one is logged
        by name and skipped); ``skip`` leaves steps out of "latest". CheckpointNotFoundError
        names the URL. ``shards=False``: a format-2 checkpoint's root alone (see :meth:`Manifests.read_manifest`).
        """
        if step is not None:
            step_dir = step_dir_of(step)
            return step_dir, await self.manifests.read_manifest(step_dir, shards=shards)
        if await self.is_committed(""):
            return "", await self.manifests.read_manifest("", shards=shards)
        return await self._latest(set(skip), shards)

    async def _latest(self, skipped: set[int], shards: bool) -> tuple[str, Manifest]:
        """The newest intact step not in ``skipped``; the first damage met if none is intact."""
        damage: Exception | None = None
        async with aclosing(self.newest_first(1)) as walk:
            async for s, found in walk:
                if s in skipped or isinstance(found, CheckpointNotFoundError):
                    continue
                try:
                    if isinstance(found, Exception):
                        raise found
                    await self.objects.check_whole(str(s), found)
                    return str(s), await self.manifests.with_shards(str(s), found, shards)
                except (ManifestError, IntegrityError, PermissionError) as e:
                    log.warning("%s: the newest step %d is damaged, trying an older one: %s", self.ctx.url, s, e)
                    damage = damage or e
                except FileNotFoundError as e:
                    if isinstance(e, CheckpointNotFoundError):
                        log.warning("%s: step %d vanished while looking for the latest: %s", self.ctx.url, s, e)
                        continue
                    log.warning("%s: the newest step %d lost data, trying an older one: %s", self.ctx.url, s, e)
                    damage = damage or e
        if damage is not None:  # nothing intact, but something damaged: say what, not "nothing"
            raise damage
        raise CheckpointNotFoundError(f"no intact committed checkpoint under {self.ctx.url}")
