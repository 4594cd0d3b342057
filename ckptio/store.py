"""Checkpoints under one root URL: where they live, which are committed, deletion, orphan sweep.

A checkpoint of step ``s`` lives in the step directory ``<root>/<s>`` (the
root itself when saved without a step); it exists once
``<step dir>/ckptio.manifest.json`` does, and it is *intact* once that
manifest validates and is bound to its place (it names step ``s``, and every
object it lists lies in step ``s``'s layout).

A save announces itself before its first object with an *intent*
(``<step dir>/ckptio.intent.<save id>``, see :mod:`ckptio.intents`) and
keeps it fresh while in flight; whatever deletes (gc, retention, a re-save's
cleanup) spares every object of a live intent, whatever its age, and
deletes only keys that :mod:`ckptio.names` proves are ckptio's.

Deletion first writes a tombstone (``ckptio.deleting``, holding the id of
the checkpoint it deletes) so no reader picks a checkpoint whose objects are
going away, then deletes the objects the manifest lists and those of dead
attempts at the same step, the manifest, and the tombstone last. A save of a
step with a leftover tombstone finishes that deletion first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import numbers
import os
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, suppress
from typing import Any

from ckptio.backends import Backend, open_backend
from ckptio.backends.base import ObjectInfo, join_key

from .engine import Engine, EngineConfig, gather_or_cancel
from .errors import (
    CheckpointNotFoundError, IntegrityError, ManifestError, SaveRevokedError, UnconfirmedCommitError,
)
from .fence import COMMIT, REVOKED, Fences, writers_of
from .layout import FanoutNaming, FlatNaming, HashedNaming, Naming
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, TOMBSTONE_NAME, Manifest, unseal
from .names import (
    INTENT_PREFIX, fence_key, intent_key, parse_fence, is_hashed_component, new_id, parse_intent, parse_object, step_of_key,
)
from .orbax_steps import OrbaxStep, orbax_step

__all__ = [
    "CheckpointStore", "StepStatus", "SweepReport", "check_grace", "step_dir_of",
    "sweeps_temporaries_by_prefix", "MAX_STEP",
]

log = logging.getLogger("ckptio.store")

#: The largest step a manifest may record (see ckptio.manifest).
MAX_STEP = 1 << 62
#: How long a save's intent stays live without a heartbeat (see ckptio.intents).
DEFAULT_LEASE_S = 120.0


def step_dir_of(step: int | None) -> str:
    """The step directory name (relative to the root); ``""`` for a step-less checkpoint."""
    if step is None:
        return ""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, 2**62], got {step!r}")
    return str(step)


def check_grace(grace_seconds: float) -> float:
    """``grace_seconds`` if it is a finite number of seconds >= 0; ValueError otherwise.

    A NaN grace compares false with every age (and slips through ``max``), a negative one
    dooms objects written after the listing began, an infinite one never sweeps an object:
    each is a typo, not a policy.
    """
    if isinstance(grace_seconds, numbers.Real) and not isinstance(grace_seconds, bool):
        with suppress(OverflowError):  # an int past float's range: refused below
            grace = float(grace_seconds)
            if math.isfinite(grace) and grace >= 0:
                return grace
    raise ValueError(f"grace_seconds must be a finite number of seconds >= 0, got {grace_seconds!r:.40}")


@dataclasses.dataclass(frozen=True)
class StepStatus:
    """One step directory as ``ckptio ls`` shows it.

    ``state``: ``committed`` (intact), ``damaged`` (a manifest that does not
    validate or is not bound to this step, or an object or fragment it names
    is missing or short), ``unreadable`` (permission denied), ``deleting`` (tombstoned),
    ``in-flight`` (a live save's intent, no manifest) or ``incomplete``
    (neither: a crashed save's leftovers, for the sweep).

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


class CheckpointStore:
    """A root URL with its backend, engine and naming strategy."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        backend: Backend | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        raw = os.fspath(url)
        if not raw.strip():
            raise ValueError("the checkpoint URL is empty (give a path or a URL such as gs://bucket/run)")
        self.url = raw.rstrip("/") or "/"
        self.backend = backend if backend is not None else open_backend(self.url, **(backend_options or {}))
        #: How another process opens the same backend (ckptio.sidecar): only a backend this store
        #: opened from its URL can be; one handed in (a wrapper, a test double) cannot.
        self.backend_options = dict(backend_options or {})
        self.reopenable = backend is None
        self.engine = Engine(self.backend, engine_config)
        self.fences = Fences(self.backend, self.engine)
        self.naming = naming or _default_naming(self.backend)
        self._manifests: dict[tuple[str, int, float], Manifest] = {}
        #: How long this store's saves' intents stay live without a heartbeat.
        self.lease_s = float(os.environ.get("CKPTIO_LEASE_S", DEFAULT_LEASE_S))
        #: Each host sees only its own objects here (a host-local fast tier): a commit cannot
        #: list other hosts' objects, so it checks none (each host's engine confirmed its own writes).
        self.host_local = False

    def where(self, step_dir: str) -> str:
        """A human-readable URL of a step directory, for error messages."""
        return f"{self.url}/{step_dir}" if step_dir else self.url

    # -- finding checkpoints ---------------------------------------------

    async def is_committed(self, step_dir: str) -> bool:
        """A manifest is present and no deletion is under way (the manifest is not validated)."""
        manifest, tombstone = await asyncio.gather(
            self._exists(join_key(step_dir, MANIFEST_NAME)), self._exists(join_key(step_dir, TOMBSTONE_NAME))
        )
        return manifest and not tombstone

    async def step_dirs(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending."""
        names = await self.engine.retrying(f"list {self.url}", lambda: self.backend.list_children(""))
        return sorted(int(n) for n in names if n.isdigit() and str(int(n)) == n and int(n) <= MAX_STEP)

    async def committed_steps(self) -> list[int]:
        """Steps with a manifest and no tombstone, ascending: two stats a step, nothing read.

        Neither validated nor fence-checked: a fenced manifest whose commit is still in flight (or
        died, or was revoked) is listed too. See :meth:`standing_steps` (fences) and
        :meth:`intact_steps` (fences and validation).
        """
        steps = await self.step_dirs()
        flags = await asyncio.gather(*(self.is_committed(str(s)) for s in steps))
        return [s for s, ok in zip(steps, flags) if ok]

    async def standing_steps(self) -> list[int]:
        """Steps with a manifest, no tombstone and a standing commit (a fenced manifest whose fence
        does not say "commit" is a save in flight, dead or revoked: not committed), ascending.

        A damaged manifest still counts here (see :meth:`intact_steps` for the steps that
        validate). Manifests are read once and cached, fences with them.
        """
        out: list[int] = []
        async with aclosing(self._newest_first(self.engine.concurrency)) as walk:
            async for step, found in walk:
                if not isinstance(found, CheckpointNotFoundError):
                    out.append(step)
        return sorted(out)

    async def status(self, step_dir: str) -> StepStatus:
        """What ``step_dir`` holds (see :class:`StepStatus`); never raises for a bad manifest."""
        step = int(step_dir) if step_dir else None
        if await self._exists(join_key(step_dir, TOMBSTONE_NAME)):
            return StepStatus(step, "deleting")
        try:
            manifest = await self.read_manifest(step_dir, shards=False)
        except (ManifestError, IntegrityError) as e:
            return StepStatus(step, "damaged", problem=str(e))
        except PermissionError as e:
            return StepStatus(step, "unreadable", problem=str(e))
        except CheckpointNotFoundError:
            pass
        else:
            try:
                await self.check_whole(step_dir, manifest)
            except (FileNotFoundError, IntegrityError) as e:
                return StepStatus(step, "damaged", problem=str(e), manifest=manifest)
            return StepStatus(step, "committed", manifest=manifest)
        live = await self.live_saves(step_dir)
        if live:
            return StepStatus(step, "in-flight")
        orbax = await orbax_step(self, step_dir) if step_dir else None
        if orbax is not None:
            return StepStatus(step, orbax.state, problem=orbax.problem, orbax=orbax)
        return StepStatus(step, "incomplete")

    async def intact_steps(
        self, newest: int | None = None, among: Iterable[int] | None = None, *, whole: bool = False
    ) -> list[int]:
        """Committed steps whose manifest validates, ascending; damaged ones are logged and left out.

        With ``newest``, stop once that many intact steps (from the newest down) are found:
        "the latest step" reads one manifest, however many steps the root holds. With
        ``among``, look at those step directories only. With ``whole``, a step counts only if
        every object (format 2: every fragment) its root manifest names is there with its size
        (:meth:`check_whole`: a listing, no data read).
        """
        return sorted(await self.intact_roots(newest, among, whole=whole))

    async def intact_roots(
        self, newest: int | None = None, among: Iterable[int] | None = None, *, whole: bool = False
    ) -> dict[int, Manifest]:
        """:meth:`intact_steps`, each with its validated root manifest (format 2: no fragment read)."""
        out: dict[int, Manifest] = {}
        async with aclosing(self._newest_first(newest or self.engine.concurrency, among)) as walk:
            async for step, found in walk:
                if isinstance(found, Manifest) and whole:
                    try:
                        await self.check_whole(str(step), found)
                    except (FileNotFoundError, IntegrityError) as e:
                        found = e
                if isinstance(found, (ManifestError, IntegrityError, PermissionError)) or (
                    isinstance(found, FileNotFoundError) and not isinstance(found, CheckpointNotFoundError)
                ):
                    log.warning("%s: step %d is damaged and skipped: %s", self.url, step, found)
                elif isinstance(found, Manifest):
                    out[step] = found
                    if newest is not None and len(out) >= newest:
                        break
        return out

    async def _newest_first(
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
            found = await asyncio.gather(*(self._read_root(str(s), explain=False) for s in chunk),
                                         return_exceptions=True)
            for step, got in zip(chunk, found):
                if isinstance(got, BaseException) and not isinstance(
                    got, (CheckpointNotFoundError, ManifestError, IntegrityError, PermissionError)
                ):
                    raise got
                yield step, got  # type: ignore[misc]
            i, batch = i + batch, max(batch, self.engine.concurrency)

    async def read_manifest(self, step_dir: str, *, shards: bool = True) -> Manifest:
        """The validated manifest of a committed checkpoint.

        CheckpointNotFoundError if there is none (or it is being deleted);
        ManifestError / IntegrityError naming the step if it is damaged, too
        large, or not bound to ``step_dir`` (copied or moved from elsewhere).
        A format-2 checkpoint comes with every fragment loaded, or with
        ``shards=False`` as its root alone (see :meth:`load_fragments`).
        """
        return await self._with_shards(step_dir, await self._read_root(step_dir), shards)

    async def _with_shards(self, step_dir: str, root: Manifest, shards: bool) -> Manifest:
        """``root`` with every fragment of a format-2 checkpoint loaded when ``shards``."""
        if shards and not root.complete:
            return await self.load_fragments(step_dir, root, None)
        return root

    async def load_fragments(self, step_dir: str, root: Manifest, wanted: Any) -> Manifest:
        """A format-2 root with the shards that meet ``wanted`` (item -> boxes; None: all) loaded."""
        from .fragments import fragments_for, load_fragments

        where = f"{self.where(step_dir)}/{MANIFEST_NAME}"
        refs = root.fragments or []
        numbers = fragments_for(root, wanted)
        datas: dict[int, bytes] = {}

        async def one(i: int) -> None:
            key = refs[i].key
            try:
                datas[i] = await self.engine.retrying(f"read fragment {key!r}", lambda: self.backend.read(key))
            except FileNotFoundError:
                raise IntegrityError(f"{where}: fragment {key!r} is missing", key=key) from None

        await gather_or_cancel((one(i) for i in numbers), limit=self.engine.concurrency * 2)
        return load_fragments(root, datas, step_dir, where, complete=wanted is None)

    async def _read_root(self, step_dir: str, *, explain: bool = True) -> Manifest:
        """The validated root manifest of ``step_dir``; ``explain=False`` skips the listing that
        tells "not committed" from "absent" in the error (a scan of steps knows the directory)."""
        where = self.where(step_dir)
        key = join_key(step_dir, MANIFEST_NAME)
        try:
            info = await self.engine.retrying(f"stat manifest of {where}", lambda: self.backend.stat(key))
            cached = self._manifests.get((step_dir, info.size, info.mtime))
            if cached is None:
                if info.size > MAX_MANIFEST_BYTES:  # refuse before reading a byte of it
                    raise ManifestError(f"{where}/{MANIFEST_NAME}: manifest of {info.size} bytes exceeds "
                                        f"{MAX_MANIFEST_BYTES}")
                data = await self.engine.retrying(f"read manifest of {where}", lambda: self.backend.read(key))
                try:
                    unseal(data, f"{where}/{MANIFEST_NAME}")
                except (IntegrityError, ManifestError):  # corrupted in flight? one more read tells
                    data = await self.engine.retrying(f"read manifest of {where}", lambda: self.backend.read(key))
        except FileNotFoundError:
            if not explain:
                raise CheckpointNotFoundError(f"checkpoint {where} is not committed") from None
            if step_dir and int(step_dir) in await self.step_dirs():
                raise CheckpointNotFoundError(
                    f"checkpoint {where} is not committed (it has no manifest): its save did not finish "
                    "or is still in flight"
                ) from None
            raise CheckpointNotFoundError(f"no checkpoint at {where}") from None
        if await self._exists(join_key(step_dir, TOMBSTONE_NAME)):
            raise CheckpointNotFoundError(f"checkpoint {where} is being deleted")
        if cached is not None:
            return cached
        manifest = Manifest.from_json(data, f"{where}/{MANIFEST_NAME}")
        check_binding(manifest, step_dir, f"{where}/{MANIFEST_NAME}")
        await self._check_fence(step_dir, manifest)
        if len(self._manifests) > 64:
            self._manifests.clear()
        if step_dir:  # a root checkpoint may be replaced in place (ckptio.dcp overwrite): never cached
            self._manifests[(step_dir, info.size, info.mtime)] = manifest
        return manifest

    async def _check_fence(self, step_dir: str, manifest: Manifest) -> None:
        """UnconfirmedCommitError unless ``manifest``'s commit stands (its fence says "commit")."""
        if not manifest.fence:
            return  # written before fencing: the manifest alone commits
        outcome = await self.fences.outcome(step_dir, manifest.fence)
        if outcome == COMMIT:
            return
        why = ("its save was revoked (paused past its lease; a deleter took its objects)" if outcome == REVOKED
               else "its commit is not confirmed (in flight, or its saver died mid-commit)")
        raise UnconfirmedCommitError(f"checkpoint {self.where(step_dir)} is not committed: {why}",
                                     manifest=manifest, outcome=outcome)

    async def _exists(self, key: str) -> bool:
        try:
            await self.engine.retrying(f"stat {key!r}", lambda: self.backend.stat(key))
            return True
        except FileNotFoundError:
            return False

    async def resolve(self, step: int | None) -> str:
        """The step directory to restore: ``step``'s, or the newest intact committed one.

        With no step, a checkpoint saved directly at the root wins; else the
        newest committed step whose manifest validates (a damaged newer one is
        logged by name and skipped). CheckpointNotFoundError names the URL.
        """
        return (await self.resolve_manifest(step, shards=False))[0]

    async def resolve_manifest(
        self, step: int | None, skip: Iterable[int] = (), *, shards: bool = True
    ) -> tuple[str, Manifest]:
        """:meth:`resolve` and the manifest it found; ``skip`` leaves steps out of "latest".

        ``shards=False``: a format-2 checkpoint's root alone (see :meth:`read_manifest`).
        """
        if step is not None:
            step_dir = step_dir_of(step)
            return step_dir, await self.read_manifest(step_dir, shards=shards)
        if await self.is_committed(""):
            return "", await self.read_manifest("", shards=shards)
        skipped = set(skip)
        damage: Exception | None = None
        async with aclosing(self._newest_first(1)) as walk:
            async for s, found in walk:
                if s in skipped or isinstance(found, CheckpointNotFoundError):
                    continue
                try:
                    if isinstance(found, Exception):
                        raise found
                    await self.check_whole(str(s), found)
                    return str(s), await self._with_shards(str(s), found, shards)
                except (ManifestError, IntegrityError, PermissionError) as e:
                    log.warning("%s: the newest step %d is damaged, trying an older one: %s", self.url, s, e)
                    damage = damage or e
                except FileNotFoundError as e:
                    if isinstance(e, CheckpointNotFoundError):
                        log.warning("%s: step %d vanished while looking for the latest: %s", self.url, s, e)
                        continue
                    log.warning("%s: the newest step %d lost data, trying an older one: %s", self.url, s, e)
                    damage = damage or e
                except CheckpointNotFoundError as e:
                    log.warning("%s: step %d vanished while looking for the latest: %s", self.url, s, e)
        if damage is not None:  # nothing intact, but something damaged: say what, not "nothing"
            raise damage
        raise CheckpointNotFoundError(f"no intact committed checkpoint under {self.url}")

    # -- objects ---------------------------------------------------------

    async def object_sizes(self, keys: Iterable[str]) -> dict[str, int]:
        """Sizes of ``keys`` that exist (absent ones are left out).

        One listing per directory the keys live in (a step directory, or each
        hashed prefix of it), not one request per object.
        """
        wanted = set(keys)
        by_dir: dict[str, list[str]] = {}
        for k in wanted:
            by_dir.setdefault(k.rpartition("/")[0], []).append(k)
        sizes: dict[str, int] = {}

        async def one(directory: str, ks: list[str]) -> None:
            if not directory or len(ks) < 4:  # the root lists everything under it: stat instead
                for k in ks:
                    try:
                        sizes[k] = (await self.engine.retrying(f"stat {k!r}", lambda k=k: self.backend.stat(k))).size
                    except FileNotFoundError:
                        pass
                return
            listed = await self.engine.retrying(f"list {directory!r}", lambda: self.backend.list(directory + "/"))
            sizes.update((i.key, i.size) for i in listed if i.key in wanted)

        await gather_or_cancel((one(d, ks) for d, ks in by_dir.items()), limit=self.engine.concurrency * 2)
        return sizes

    async def check_whole(self, step_dir: str, manifest: Manifest) -> None:
        """FileNotFoundError / IntegrityError unless every key ``manifest`` names is there, as long as
        its records need: a format-1 checkpoint's objects, a format-2 root's fragments (each
        fragment's objects are checked when it is loaded). Costs listings, not reads. A missing
        key of a committed checkpoint is damage: IntegrityError names it."""
        try:
            await self.check_objects(manifest, f"checkpoint {self.where(step_dir)}")
        except CheckpointNotFoundError:
            raise
        except FileNotFoundError as e:
            raise IntegrityError(str(e)) from None

    async def check_objects(self, manifest: Manifest, where: str) -> None:
        """FileNotFoundError unless every object ``manifest`` names exists, at least as long as its extents need."""
        need = manifest_object_sizes(manifest)
        need.update((f.key, f.size) for f in manifest.fragments or [])
        have = await self.object_sizes(need)
        for key, size in need.items():
            if key not in have:
                raise FileNotFoundError(f"{where}: object {key!r} is missing (deleted by someone, or never written)")
            if have[key] < size:
                raise IntegrityError(f"{where}: object {key!r} holds {have[key]} bytes, its extents need {size}",
                                     key=key)

    # -- intents ---------------------------------------------------------

    async def announce(
        self, step_dir: str, save_id: str, host: int = 0, lease_s: float = DEFAULT_LEASE_S,
        covers: Iterable[str] = (),
    ) -> None:
        """Write (or refresh) a save's intent: from now on its objects are spared by every deleter.

        ``covers``: further save ids whose objects this writer produces or keeps (a copy keeps
        the source's object names; a DCP save's ranks share one id).
        """
        doc = {"save_id": save_id, "step": int(step_dir) if step_dir else None, "host": host,
               "lease_s": lease_s, "heartbeat": time.time(), "covers": sorted(set(covers))}
        data = memoryview(json.dumps(doc).encode())
        key = intent_key(step_dir, save_id)
        await self.engine.retrying(f"announce {self.where(step_dir)}", lambda: self.backend.write(key, [data]))

    async def retire(self, step_dir: str, save_id: str) -> None:
        """Remove a save's intent (after its commit, or its failure)."""
        await self._delete_keys([intent_key(step_dir, save_id)])

    async def live_saves(self, step_dir: str, listing: list[ObjectInfo] | None = None) -> set[str]:
        """Save ids with a live intent in ``step_dir`` (heartbeat younger than its lease)."""
        if listing is None:
            prefix = join_key(step_dir, INTENT_PREFIX)
            listing = await self.engine.retrying(f"list {prefix!r}", lambda: self.backend.list(prefix))
        live: set[str] = set()
        for info in listing:
            name = parse_intent(info.key)
            if name is not None and name.step_dir == step_dir:
                live |= await self._intent_covers(info, name.save_id)
        return live

    async def _intent_covers(self, info: ObjectInfo, save_id: str) -> set[str]:
        """The save ids a live intent protects (none once its heartbeat is older than its lease).

        An intent retired while we look protects its ids this round (its save just committed);
        an unreadable one protects at least its own id.
        """
        try:
            doc = json.loads(await self.engine.retrying(f"read {info.key!r}", lambda: self.backend.read(info.key)))
            lease = float(doc.get("lease_s", DEFAULT_LEASE_S))
            covers = {save_id, *(c for c in doc.get("covers", []) if isinstance(c, str))}
        except FileNotFoundError:
            return {save_id}
        except (ValueError, TypeError, AttributeError):
            lease, covers = DEFAULT_LEASE_S, {save_id}
        return covers if time.time() - info.mtime < lease else set()

    # -- commit ----------------------------------------------------------

    async def commit(self, step_dir: str, manifest: Manifest, data: bytes | None = None) -> None:
        """Write the manifest once, atomically, after checking it.

        Refuses (ManifestError) a manifest not bound to ``step_dir``, and
        (FileNotFoundError / IntegrityError) one naming an object that is not
        there with its recorded size: a gc, an ``rm -rf`` or a lost write
        must fail the save, never commit a checkpoint that cannot restore.
        FileExistsError if the checkpoint exists. ``data``: the manifest's bytes when they are
        not ``manifest.to_json()`` (a format-2 root, see ckptio.fragments); they carry their own
        fence id, else (``data`` None) the commit gets a fresh one.

        The commit is fenced (:mod:`ckptio.fence`): after the manifest is created it stands only
        if no deleter revoked a save whose objects it names; otherwise the manifest is removed
        and SaveRevokedError raised. A reader never counts the manifest before that.
        """
        where = self.where(step_dir)
        if data is None:  # encoded here: under a fence of this commit's own
            manifest = dataclasses.replace(manifest, fence=new_id())
        check_binding(manifest, step_dir, where)
        if not self.host_local:
            await self.check_objects(manifest, f"commit of {where}")
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        key = join_key(step_dir, MANIFEST_NAME)
        if await self._exists(tomb) and not await self._exists(key):
            # A deletion died after removing its manifest (its objects went before it): finish it.
            await self._delete_keys([tomb])
        if data is None:
            data = manifest.to_json()
        try:
            await self.engine.retrying(f"commit {where}", lambda: self.backend.create_if_absent(key, data))
        except FileExistsError:
            # A retried create may meet its own first attempt, which won but lost its reply:
            # the manifest is unique to this save (id, time), so equal bytes mean we won.
            try:
                ours = await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key)) == data
            except FileNotFoundError:
                ours = False
            if not ours:
                raise FileExistsError(f"checkpoint {where} is already committed") from None
        await self._confirm(step_dir, key, manifest, data)
        await self._remember(step_dir, key, manifest, len(data))

    async def _confirm(self, step_dir: str, key: str, manifest: Manifest, data: bytes) -> None:
        """Steps 3-5 of a fenced commit (:mod:`ckptio.fence`): the commit stands, or it is rolled back."""
        if not manifest.fence:
            return
        revoked = await self.fences.revoked(step_dir) & writers_of(manifest.keys())
        stood = await self.fences.claim(step_dir, manifest.fence, REVOKED if revoked else COMMIT)
        if stood == COMMIT:
            if await self._still_ours(key, manifest.fence, data):
                return
            # Revoked, deleted with its step and fence, and only then did our claim land: the fence
            # we created names no manifest. Remove it; the step is not ours any more.
            await self._delete_keys([fence_key(step_dir, manifest.fence)])
            raise SaveRevokedError(f"commit of {self.where(step_dir)} rolled back: the save stalled past its "
                                   f"lease ({self.lease_s:g} s) and its step was deleted meanwhile")
        # Our manifest can never count (its fence says revoked): out of the way of a re-save. The
        # objects are the deleter's to remove (revoked, so no commit can name them again).
        await self._delete_keys([key])
        who = f"save {sorted(revoked)[0]}" if revoked else "this save"
        raise SaveRevokedError(
            f"commit of {self.where(step_dir)} rolled back: {who} stalled past its lease "
            f"({self.lease_s:g} s) and a deleter (gc, retention) revoked it and took its objects"
        )

    async def _still_ours(self, key: str, fence: str, data: bytes) -> bool:
        """True if the manifest at ``key`` is the one this commit created (it names our fence)."""
        try:
            there = await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key))
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
        """Cache the manifest just committed, as :meth:`_read_root` would after reading it back: the
        retention that follows a save must not parse a 100k-item manifest this process just built."""
        if not step_dir:
            return  # a root checkpoint may be replaced in place: never cached
        try:
            info = await self.backend.stat(key)
        except Exception:  # noqa: BLE001 -- committed already: a cache miss only costs a read later
            return
        if info.size == size:  # ours (create_if_absent is exclusive): keyed like any read of it
            if len(self._manifests) > 64:
                self._manifests.clear()
            self._manifests[(step_dir, info.size, info.mtime)] = manifest

    async def prepare_save(self, step_dir: str) -> None:
        """Before a save of ``step_dir``: finish an interrupted deletion there; refuse a committed step."""
        where = self.where(step_dir)
        if await self._exists(join_key(step_dir, TOMBSTONE_NAME)):
            log.warning("%s: an earlier deletion of this step was interrupted; finishing it before saving", where)
            await self.delete(step_dir)
        elif await self._exists(join_key(step_dir, MANIFEST_NAME)):
            try:
                await self._read_root(step_dir)
            except UnconfirmedCommitError as e:
                if e.outcome != REVOKED:
                    raise FileExistsError(
                        f"checkpoint {where} has a manifest whose commit is not confirmed: a save of this "
                        "step is committing, or died mid-commit (`ckptio gc` settles it once its lease ends)"
                    ) from None
                log.warning("%s: removing the manifest of a revoked save before saving", where)
                await self.delete(step_dir)
                return
            except (ManifestError, IntegrityError, CheckpointNotFoundError):
                pass
            raise FileExistsError(f"checkpoint {where} is already committed")

    # -- deletion --------------------------------------------------------

    async def delete(self, step_dir: str) -> None:
        """Delete a checkpoint: tombstone, objects, dead attempts, manifest, tombstone (crash-safe order).

        Deletes only keys of ``step_dir``'s own layout that :mod:`ckptio.names`
        proves are ckptio's, never an object of a live save, and never
        anything a manifest lists outside the step (a copied step directory).
        """
        where = self.where(step_dir)
        key = join_key(step_dir, MANIFEST_NAME)
        tomb = join_key(step_dir, TOMBSTONE_NAME)
        manifest: Manifest | None = None
        try:
            data = await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key))
            manifest = Manifest.from_json(data, where)
        except FileNotFoundError:
            pass
        except (ManifestError, IntegrityError, RecursionError) as e:
            log.warning("deleting %s: its manifest is unreadable (%s); deleting by name only", where, e)
        marker = (manifest.checkpoint_id if manifest is not None else "").encode()
        committed = manifest is not None and await self._settle_fence(step_dir, manifest)
        fence_id = manifest.fence if manifest is not None else None
        finished = writers_of(manifest.keys()) if committed and manifest is not None else set()
        if manifest is not None and not manifest.complete:
            try:  # format 2: the objects are named in the fragments
                manifest = await self.load_fragments(step_dir, manifest, None)
            except (ManifestError, IntegrityError) as e:
                # The root alone names no data objects: find them by name, under every hashed prefix.
                log.warning("deleting %s: a fragment is unreadable (%s); deleting by name only", where, e)
                manifest = None
        try:
            await self.engine.retrying(f"tombstone {where}", lambda: self.backend.create_if_absent(tomb, marker))
        except FileExistsError:
            pass  # an earlier deletion was interrupted: finish it
        listing = await self._step_listing(step_dir, everywhere=manifest is None or await self._other_attempts(
            step_dir, manifest))
        live = await self.live_saves(step_dir, [i for i in listing if parse_intent(i.key)])
        owned = manifest.keys() if manifest is not None else []
        keys = {k for k in owned if step_of_key(k) == step_dir}
        foreign = len(owned) - len(keys)
        if foreign:
            log.warning("deleting %s: its manifest names %d objects outside the step; left alone", where, foreign)
        for info in listing:
            name = parse_object(info.key)
            if name is not None and name.step_dir == step_dir and name.save_id not in live:
                keys.add(info.key)
        # Objects a standing commit names belong to a finished save; any other writer is revoked
        # first, so that if it is only paused it can never commit them (ckptio.fence).
        await self.fences.revoke(step_dir, writers_of(keys) - finished)
        await self._delete_keys(sorted(keys))
        dead_intents = [i.key for i in listing
                        if (n := parse_intent(i.key)) is not None and n.save_id not in live]
        await self._delete_keys(dead_intents)
        await self._delete_keys([key])
        # Fences go after the manifest (a paused committer whose claim lands later finds its manifest
        # gone and fails: ckptio.fence, step 5).
        fences = {i.key for i in listing if parse_fence(i.key) is not None and parse_fence(i.key).step_dir == step_dir}
        if fence_id:
            fences.add(fence_key(step_dir, fence_id))
        await self._delete_keys(sorted(fences))
        await self._delete_keys([tomb])
        self._manifests = {k: v for k, v in self._manifests.items() if k[0] != step_dir}
        log.info("deleted checkpoint %s (%d objects)", where, len(keys))

    async def _settle_fence(self, step_dir: str, manifest: Manifest) -> bool:
        """True if ``manifest``'s commit stands; an unclaimed fence is claimed "revoked" first, so a
        committer paused before confirming can never make what is being deleted count."""
        if not manifest.fence:
            return True
        outcome = await self.fences.outcome(step_dir, manifest.fence)
        if outcome is None:
            outcome = await self.fences.claim(step_dir, manifest.fence, REVOKED)
        return outcome == COMMIT

    async def _other_attempts(self, step_dir: str, manifest: Manifest) -> bool:
        """True if intents of saves other than ``manifest``'s writers remain in ``step_dir``."""
        prefix = join_key(step_dir, INTENT_PREFIX)
        listed = await self.engine.retrying(f"list {prefix!r}", lambda: self.backend.list(prefix))
        writers = {n.save_id for k in manifest.keys() if (n := parse_object(k)) is not None}
        return any((n := parse_intent(i.key)) is not None and n.save_id not in writers for i in listed)

    async def _step_listing(self, step_dir: str, *, everywhere: bool) -> list[ObjectInfo]:
        """Everything under ``step_dir``; with ``everywhere``, under each hashed prefix's ``<h>/<step>/`` too."""
        if not step_dir:
            return []  # a root checkpoint shares its directory with everything else: delete by manifest only
        own = await self.engine.retrying(f"list {step_dir!r}", lambda: self.backend.list(step_dir + "/"))
        if not everywhere:
            return own
        prefixes = [c for c in await self.engine.retrying(f"list {self.url}", lambda: self.backend.list_children(""))
                    if is_hashed_component(c)]
        out = list(own)

        async def one(p: str) -> None:
            prefix = f"{p}/{step_dir}/"
            out.extend(await self.engine.retrying(f"list {prefix!r}", lambda: self.backend.list(prefix)))

        await gather_or_cancel((one(p) for p in prefixes), limit=self.engine.concurrency * 2)
        return out

    async def _delete_keys(self, keys: Iterable[str]) -> None:
        async def one(key: str) -> None:
            try:
                await self.engine.retrying(f"delete {key!r}", lambda: self.backend.delete(key))
            except FileNotFoundError:
                pass

        await gather_or_cancel((one(k) for k in keys), limit=self.engine.concurrency * 2)

    async def sweep(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> SweepReport:
        """Delete what crashed saves left: ckptio's objects that no intact manifest names.

        An object goes only if its key is one ckptio writes (:mod:`ckptio.names`),
        it is older than ``grace_seconds``, no live save announced it (whatever
        its age), and its step's manifest is not damaged (a damaged step's
        objects are kept for inspection). Also finishes interrupted deletions,
        removes dead saves' intents, and the temporary files of killed writes
        (:meth:`Backend.sweep_temporaries`). Never raises for one bad step.
        """
        grace_seconds = check_grace(grace_seconds)
        report = SweepReport()
        now = time.time()
        report.temporaries = await self.engine.retrying(
            f"sweep temporaries of {self.url}",
            lambda: self.backend.sweep_temporaries(self._temporary_grace(grace_seconds), dry_run=dry_run),
        )
        listing = await self.engine.retrying(f"list {self.url}", lambda: self.backend.list(""))
        by_step: dict[str, list[ObjectInfo]] = {}
        for info in listing:
            name = parse_object(info.key) or parse_intent(info.key) or parse_fence(info.key)
            if name is not None:
                by_step.setdefault(name.step_dir, []).append(info)
        markers = {i.key for i in listing if i.key.rpartition("/")[2] in (MANIFEST_NAME, TOMBSTONE_NAME)}
        for key in markers:  # a step whose deletion died after its objects went holds markers only
            parent = key.rpartition("/")[0]
            if parent == "" or (parent.isdigit() and str(int(parent)) == parent):
                by_step.setdefault(parent, [])
        await self._sweep_steps(by_step, markers, now, grace_seconds, dry_run, report)
        return report

    async def sweep_step(
        self, step: int, grace_seconds: float = 3600.0, *, dry_run: bool = False
    ) -> SweepReport:
        """:meth:`sweep` for one step only: what crashed or killed saves of ``step`` left.

        The same rules, deleting only keys of ``step``'s own layout (its directory, and
        ``<h>/<step>/`` under each hashed prefix); never lists the whole root, never touches
        another step. Temporary files of killed writes go only where the backend can find
        them under the step (``sweep_temporaries(..., prefix=...)``), and only while no
        live save is announced in the step: a temporary cannot say whose write it is.
        ``step`` must be an int: a step-less checkpoint shares the root with everything,
        sweep it with :meth:`sweep`.
        """
        if step is None:
            raise ValueError("sweep_step needs a step: a checkpoint saved at the root is swept by sweep()")
        step_dir = step_dir_of(step)
        grace_seconds = check_grace(grace_seconds)
        report = SweepReport()
        now = time.time()
        listing = await self._step_listing(step_dir, everywhere=True)
        infos = [i for i in listing if (n := parse_object(i.key) or parse_intent(i.key) or parse_fence(i.key)) is not None
                 and n.step_dir == step_dir]
        markers = {i.key for i in listing if i.key in (join_key(step_dir, MANIFEST_NAME),
                                                       join_key(step_dir, TOMBSTONE_NAME))}
        live, protected = await self._sweep_steps(
            {step_dir: infos}, markers, now, grace_seconds, dry_run, report)
        if not live[step_dir] and step_dir not in protected:
            report.temporaries = await self._step_temporaries(step_dir, grace_seconds, dry_run)
        return report

    async def _step_temporaries(self, step_dir: str, grace_seconds: float, dry_run: bool) -> list[str]:
        """The temporaries under ``step_dir`` older than ``grace_seconds``, swept; none where the
        backend can only sweep its whole root (that is :meth:`sweep`'s job, not one step's)."""
        if not sweeps_temporaries_by_prefix(self.backend):
            log.debug("%s: the backend sweeps temporaries root-wide only; left to gc", self.where(step_dir))
            return []
        sweep: Any = self.backend.sweep_temporaries  # typed without ``prefix`` in the Backend ABC
        return await self.engine.retrying(
            f"sweep temporaries of {self.where(step_dir)}",
            lambda: sweep(self._temporary_grace(grace_seconds), dry_run=dry_run, prefix=step_dir + "/"),
        )

    def _temporary_grace(self, grace_seconds: float) -> float:
        """A temporary cannot say whose write it is, so it goes only once a lease has passed
        since its last byte: a write in flight keeps its mtime fresh, and a grace of 0 (``gc
        --grace 0``) must not pull the file from under a live save's write."""
        return max(grace_seconds, self.lease_s)

    async def _sweep_steps(
        self, by_step: dict[str, list[ObjectInfo]], markers: set[str], now: float, grace_seconds: float,
        dry_run: bool, report: SweepReport,
    ) -> tuple[dict[str, set[str]], set[str]]:
        """The sweep of the steps in ``by_step`` (their objects' and intents' listings; ``markers``: the
        manifests and tombstones listed; ``now``: the time before the listing), into ``report``.

        Returns the live save ids of each step, and the steps left alone (a deletion finished,
        a damaged manifest, or one changing under us).
        """
        keep: set[str] = set()
        protected: set[str] = set()  # step dirs whose objects nobody may sweep now
        unconfirmed: dict[str, Manifest] = {}  # manifests whose fence does not say "commit"
        for step_dir in sorted(by_step, key=lambda s: (len(s), s)):
            if join_key(step_dir, TOMBSTONE_NAME) in markers:
                if not dry_run:
                    await self.delete(step_dir)
                report.finished_deletions.append(int(step_dir) if step_dir else None)
                protected.add(step_dir)
                continue
            if join_key(step_dir, MANIFEST_NAME) in markers:
                try:
                    kept = await self.read_manifest(step_dir)
                    keep.update(kept.keys())
                    if kept.fence:
                        keep.add(fence_key(step_dir, kept.fence))
                except UnconfirmedCommitError as e:
                    unconfirmed[step_dir] = e.manifest  # type: ignore[assignment]
                except CheckpointNotFoundError:
                    protected.add(step_dir)  # changing under us: leave it to the next sweep
                except (ManifestError, IntegrityError) as e:
                    log.warning("gc %s: step %r is damaged, its objects are kept: %s", self.url, step_dir, e)
                    report.damaged.append(step_dir)
                    protected.add(step_dir)
        live: dict[str, set[str]] = {}
        for step_dir, infos in by_step.items():
            live[step_dir] = await self.live_saves(step_dir, [i for i in infos if parse_intent(i.key)])
        dead = await self._dead_commits(unconfirmed, live, protected, now, grace_seconds, dry_run)
        doomed: dict[str, list[ObjectInfo]] = {}
        for step_dir, infos in by_step.items():
            if step_dir in protected:
                continue
            for info in infos:
                name = parse_object(info.key)
                if name is None or info.key in keep:
                    continue
                if name.save_id in live[step_dir]:
                    report.spared_in_flight += 1
                elif now - info.mtime >= grace_seconds:
                    doomed.setdefault(step_dir, []).append(info)
        for step_dir, infos in doomed.items():
            again = await self.live_saves(step_dir)
            gone = [i for i in infos if parse_object(i.key).save_id not in again]  # type: ignore[union-attr]
            if gone and not dry_run:
                gone = await self._revoke_before_deleting(step_dir, gone)
            report.objects += [i.key for i in gone]
            report.bytes += sum(i.size for i in gone)
        intents = [i for infos in by_step.values() for i in infos if (n := parse_intent(i.key)) is not None
                   and n.step_dir not in protected and n.save_id not in live[n.step_dir]
                   and now - i.mtime >= grace_seconds]
        report.intents = [i.key for i in intents]
        if not dry_run:
            await self._delete_keys(report.objects)
            await self._delete_keys(report.intents)
        # A revoked commit's manifest goes after the objects it names: it never counted anyway.
        gone = [join_key(d, MANIFEST_NAME) for d in dead]
        gone += [fence_key(d, unconfirmed[d].fence) for d in dead if unconfirmed[d].fence]  # type: ignore[arg-type]
        stray = await self._stray_fences(by_step, keep, protected, set(dead), now, grace_seconds)
        gone += stray
        report.objects += gone
        if not dry_run:
            await self._delete_keys(stray)
            await self._delete_keys(gone[: len(dead)])
            await self._delete_keys(gone[len(dead) :])  # fences after manifests (ckptio.fence, step 5)
        report.objects.sort()
        return live, protected

    async def _stray_fences(
        self, by_step: dict[str, list[ObjectInfo]], keep: set[str], protected: set[str], dead: set[str],
        now: float, grace_seconds: float,
    ) -> list[str]:
        """Fences no manifest names any more: a commit rolled back (its fence says "revoked", its
        manifest is gone) or one whose step was deleted before its claim landed. A fence is created
        after its manifest, so one that the step's current manifest does not name can never count
        again; deleting it is safe even under a paused committer (ckptio.fence, step 5)."""
        out: list[str] = []
        for step_dir, infos in by_step.items():
            if step_dir in protected or step_dir in dead:
                continue
            fences = [i for i in infos if parse_fence(i.key) is not None and i.key not in keep
                      and now - i.mtime >= grace_seconds]
            if not fences:
                continue
            key = join_key(step_dir, MANIFEST_NAME)
            try:  # read again: a commit may have made its manifest since the listing
                current = Manifest.from_json(
                    await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key)), key).fence
            except FileNotFoundError:
                current = None
            except (ManifestError, IntegrityError):
                continue  # cannot tell which fence is its: leave them all
            out += [i.key for i in fences if parse_fence(i.key).save_id != current]  # type: ignore[union-attr]
        return out

    async def _dead_commits(
        self, unconfirmed: dict[str, Manifest], live: dict[str, set[str]], protected: set[str], now: float,
        grace_seconds: float, dry_run: bool,
    ) -> list[str]:
        """The steps of ``unconfirmed`` whose commit is dead: revoked, or unconfirmed with every
        writer's lease ended (they are revoked now, and their fence claimed "revoked"). A commit
        still in flight, or that turns out to stand, puts its step in ``protected``."""
        dead: list[str] = []
        for step_dir, m in unconfirmed.items():
            writers = writers_of(m.keys())
            if writers & live.get(step_dir, set()) or now - m.created < grace_seconds or dry_run:
                protected.add(step_dir)
                continue
            await self.fences.revoke(step_dir, writers)
            if await self._settle_fence(step_dir, m):
                protected.add(step_dir)  # it confirmed before our claim: committed after all
            else:
                dead.append(step_dir)
        return dead

    async def _revoke_before_deleting(self, step_dir: str, infos: list[ObjectInfo]) -> list[ObjectInfo]:
        """Revoke the saves that wrote ``infos`` (dead or paused), then return those that may go.

        A commit may have created its manifest since the listing: if it names one of these saves,
        its fence decides (claimed "revoked" here if still open). Objects of a commit that stands
        are kept; so is everything in a step whose manifest appeared but cannot be read.
        """
        sids = writers_of(i.key for i in infos)
        await self.fences.revoke(step_dir, sids)
        key = join_key(step_dir, MANIFEST_NAME)
        try:
            m = Manifest.from_json(await self.engine.retrying(f"read {key!r}", lambda: self.backend.read(key)),
                                   self.where(step_dir))
        except FileNotFoundError:
            return infos
        except (ManifestError, IntegrityError) as e:
            log.warning("gc %s: a manifest appeared in step %r and cannot be read; its objects are kept: %s",
                        self.url, step_dir, e)
            return []
        named = writers_of(m.keys()) & sids
        if named and await self._settle_fence(step_dir, m):
            return [i for i in infos if parse_object(i.key).save_id not in named]  # type: ignore[union-attr]
        return infos

    async def close(self) -> None:
        self.engine.close()
        await self.backend.close()


def sweeps_temporaries_by_prefix(backend: Backend) -> bool:
    """True if ``backend.sweep_temporaries`` takes a ``prefix`` (sweeps one step's temporaries only).

    The Backend ABC's sweep walks the whole root; a backend (or wrapper) that can
    limit it to a prefix declares so (:attr:`Capabilities.sweeps_by_prefix`).
    """
    return backend.capabilities.sweeps_by_prefix


def check_binding(manifest: Manifest, step_dir: str, where: str) -> None:
    """ManifestError unless ``manifest`` belongs in ``step_dir``: the step it records, and objects in that step.

    A manifest copied or moved into another step directory would otherwise
    restore the other step's data under this step's name (and a deletion of
    the copy would delete the original's objects).
    """
    if step_dir:
        if manifest.step != int(step_dir):
            raise ManifestError(f"{where}: the manifest is for step {manifest.step}, not {step_dir} "
                                "(copied or moved from elsewhere?)")
    for key in manifest.keys():
        if step_of_key(key) != step_dir:
            raise ManifestError(f"{where}: object {key!r} lies outside this checkpoint's step "
                                "(copied or moved from elsewhere?)")


def manifest_object_sizes(manifest: Manifest) -> dict[str, int]:
    """The least size of each object of ``manifest``: the end of its last extent (0 if it holds none)."""
    from .manifest import ArrayItem
    from .packtable import split_items

    ends = [0] * len(manifest.objects)  # by object number: one list index per extent (100k-leaf states)
    plain, tables = split_items(manifest.items)
    for t in tables:  # a pack table: one extent
        ends[t.object] = max(ends[t.object], t.offset + t.ends[-1])
    for item in plain.values():
        if isinstance(item, ArrayItem):
            for shard in item.shards:
                for e in shard.extents:
                    end = e.offset + e.length
                    if end > ends[e.object]:
                        ends[e.object] = end
    need = dict.fromkeys(manifest.objects, 0)
    for key, end in zip(manifest.objects, ends):
        need[key] = max(need[key], end)  # a key listed twice keeps its larger need
    return need


def _default_naming(backend: Backend) -> Naming:
    layout = backend.layout_defaults
    if layout.hashed_names:
        return HashedNaming()
    if layout.dir_fanout > 0:
        return FanoutNaming(layout.dir_fanout)
    return FlatNaming()
