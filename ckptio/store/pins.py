"""Pins: a save announces the steps whose objects it references before it references them.

Key: ``ckptio.pins/<base>.<step>.<save id>``, created once, empty: "save ``save id`` of step
``step`` references objects of step ``base``". It is the reverse index a deleter of ``base``
reads (one listing of one prefix) instead of every manifest of the root. The protocol and
the argument that no interleaving loses a referenced object are in docs/incremental.md
(section 3); in short:

* a referencing save creates its pin (R1), *then* checks that the base still stands: no
  tombstone, its committed manifest the one it read (R2, :meth:`Pins.pin`);
* a deleter of the base writes its tombstone (D1), *then* lists the base's pins and keeps what
  they may reference (D2, :meth:`Pins.judge`): everything, for a save still alive; the keys its
  manifest names, for a save whose commit stands; nothing, for a save that is dead -- which it
  revokes first (:mod:`ckptio.store.fence`), so that if only paused it can never commit the reference.

Either the deleter's listing sees the pin, or the pin came after it, hence after the
tombstone, and the save's check sees the tombstone (or no manifest) and references nothing.

**Holds: the guard against an older ckptio.** An older version cannot see pins, so its gc
would take a deleted base's objects as orphans, and its ``delete`` would take them by name.
Every version spares the objects of a live save, and an intent's doc declares its own lease.
So with each pin comes a *hold*: an intent ``<base>/ckptio.intent.<save id>`` (never that save's
own intent: a save never pins its own step) with a lease no clock reaches, covering the writers
of the base's objects the save references. An older deleter then spares them whatever it
makes of the step; this version ignores holds (``"hold"`` in the doc: pins decide), never
removes one whose pin stands, and removes each right after its pin (:meth:`Pins.unpin`). A
hold left by a crash between the two is a dead intent to this version's gc.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable

from ckptio.backends import Backend
from ckptio.backends.base import join_key
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import TOMBSTONE_NAME, Manifest
from ckptio.manifest.fragments import fragment_key
from ckptio.manifest.names import intent_key, step_of_key
from ckptio.manifest.refs import referenced
from ckptio.store.fence import Fences

__all__ = ["HOLD_LEASE_S", "PIN_DIR", "Judgement", "PinName", "Pins", "hold_key", "parse_pin", "pin_key"]

log = logging.getLogger("ckptio.incremental")

#: ``(step_dir, format-2 root, fragment number)`` -> the object keys that fragment names.
FragmentObjects = Callable[[str, Manifest, int], Awaitable[list[str]]]

#: Pins live in one folder at the root (like revocations): a base's pins are one prefix.
PIN_DIR = "ckptio.pins"
_STEP = r"0|[1-9][0-9]{0,18}"
_PIN = re.compile(rf"{PIN_DIR}/(?P<base>{_STEP})\.(?P<step>{_STEP})\.(?P<sid>[0-9a-f]{{12}})")
#: A hold's lease: live to every clock (an older ckptio judges an intent by the lease it declares).
HOLD_LEASE_S = 1e18
#: How long R2 waits for a deletion of an older step than its base (another host's retention) to end
#: before it gives up on referencing it (the save then fails; the next one writes in full).
DELETION_WAIT_S = 120.0


@dataclasses.dataclass(frozen=True)
class PinName:
    """A parsed pin: save ``save_id`` of ``step_dir`` references objects of ``base``."""

    key: str
    base: str
    step_dir: str
    save_id: str


def pin_key(base: str, step_dir: str, save_id: str) -> str:
    """The pin of save ``save_id`` of ``step_dir`` on step ``base`` (both step directories, not the root)."""
    if not base or not step_dir:
        raise ValueError("incremental saves reference steps, not the root: a step is needed")
    return f"{PIN_DIR}/{base}.{step_dir}.{save_id}"


def hold_key(pin: PinName) -> str:
    """The hold that goes with ``pin``: an intent in the base's step under the pinning save's id."""
    return intent_key(pin.base, pin.save_id)


def parse_pin(key: str) -> PinName | None:
    """The pin ``key`` names; None for any other key (never ours to delete)."""
    m = _PIN.fullmatch(key)
    return PinName(key, m["base"], m["step"], m["sid"]) if m else None


@dataclasses.dataclass
class Judgement:
    """What a deleter of a base must keep for its pins (:meth:`Pins.judge`)."""

    #: A pinning save may still reference any object of the base (alive, or unreadable): keep all.
    keep_all: bool = False
    #: Keys of the base that a standing commit references.
    keep: set[str] = dataclasses.field(default_factory=set)
    #: Pins of saves that were revoked and never committed: they can never matter again.
    dead: list[str] = dataclasses.field(default_factory=list)
    #: The save ids of every pin seen: their holds in the base are removed only with their pins.
    pinners: set[str] = dataclasses.field(default_factory=set)


class Pins:
    """The pins of one store.

    ``io``: its retrying backend; ``read_unchecked``: a step's manifest as stored (FileNotFoundError if
    none); ``live_saves``: the save ids whose intent beats in a step; ``settle``: whether a manifest's
    commit stands, an unclaimed fence claimed "revoked" first (the deleters' rule)."""

    def __init__(self, io: Backend, fences: Fences, read_unchecked: Callable[[str], Awaitable[Manifest]],
                 live_saves: Callable[[str], Awaitable[set[str]]],
                 settle: Callable[[str, Manifest], Awaitable[bool]],
                 fragment_objects: FragmentObjects | None = None) -> None:
        self.io = io
        self.fences = fences
        self.read_unchecked = read_unchecked
        self.live_saves = live_saves
        self.settle = settle
        #: The object keys one fragment of a format-2 root names (where a multi-host save's host keeps
        #: its references): ``(step_dir, root, fragment number)``. None: such a pin keeps everything.
        self.fragment_objects = fragment_objects

    async def pin(self, base: str, step_dir: str, save_id: str, checkpoint_id: str, via: str | None = None,
                  covers: Iterable[str] = ()) -> bool:
        """R1 and R2: pin ``base`` (the step whose objects will be referenced) for save ``save_id`` of
        ``step_dir``, then check that no deletion of ``base`` is under way and that the manifest the
        references are read from -- step ``via`` (default ``base``), commit ``checkpoint_id`` --
        still stands there. False: reference nothing (the pin is removed; write the bytes instead).

        ``via`` differs from ``base`` when the references are flattened: ``via`` reused them from
        ``base``, which may be deleted already (its objects held by the pins of ``via`` and others).
        ``covers``: the writers of the objects of ``base`` it references (its hold's, for older ckptio).
        """
        key = pin_key(base, step_dir, save_id)
        if via is not None and via != base:
            # Before the pin too: a deletion under way that lists it keeps all of ``base`` (a live
            # save's pin), until gc; one that does not see it deletes what only ``base`` needed.
            await self._deletion_over(base, DELETION_WAIT_S)
        try:
            await self.io.create_if_absent(key, b"")
        except FileExistsError:
            pass  # a retried create that won the first time
        # After the pin: a gc that lists the hold then finds its pin, and never takes it.
        doc = {"save_id": save_id, "step": int(base), "host": 0, "lease_s": HOLD_LEASE_S, "heartbeat": time.time(),
               "covers": sorted(set(covers)), "hold": key}
        await self.io.write(hold_key(parse_pin(key)), [memoryview(json.dumps(doc).encode())])  # type: ignore[arg-type]
        via = base if via is None else via
        deadline = time.monotonic() + DELETION_WAIT_S
        while True:
            if via != base:
                # With many hosts the coordinator's retention may be deleting this older step right
                # now, beside this host's next save. A deletion that finished before the check below is
                # harmless (its D2 kept what ``via``'s standing commit names; docs/incremental.md, R2):
                # wait for it rather than fail the save -- but never check while it runs, as that D2
                # may yet judge ``via``'s pin after ``via`` itself went.
                await self._deletion_over(base, deadline - time.monotonic())
            if not await self._being_deleted(base) and await self._stands(via, checkpoint_id):
                return True
            # A deletion of the older step that began after the wait (retention on another host, a
            # moment later than this save): wait for it too, then check again.
            if via == base or time.monotonic() >= deadline or not await self._being_deleted(base):
                break
        await self.unpin([key])
        return False

    async def _deletion_over(self, step_dir: str, limit_s: float) -> None:
        """Wait up to ``limit_s`` for a deletion of ``step_dir`` under way (its tombstone) to end."""
        deadline, pause = time.monotonic() + limit_s, 0.02
        while await self._being_deleted(step_dir) and time.monotonic() < deadline:
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    async def _being_deleted(self, step_dir: str) -> bool:
        try:
            await self.io.stat(join_key(step_dir, TOMBSTONE_NAME))
            return True
        except FileNotFoundError:
            return False

    async def _stands(self, step_dir: str, checkpoint_id: str) -> bool:
        """Whether the commit of ``checkpoint_id`` stands at ``step_dir``, no deletion under way (a
        format-2 root: one that lists the fragment of save ``checkpoint_id``, a host's)."""
        if await self._being_deleted(step_dir):
            return False
        try:
            m = await self.read_unchecked(step_dir)
        except (FileNotFoundError, ManifestError, IntegrityError):
            return False
        # Many hosts: ``checkpoint_id`` is the host's own save id there, which its fragment's key names.
        if m.checkpoint_id != checkpoint_id and (m.fragments is None or all(
                f.key != fragment_key(step_dir, checkpoint_id) for f in m.fragments)):
            return False
        return not m.fence or await self.fences.outcome(step_dir, m.fence) == b"commit"

    async def unpin(self, keys: Iterable[str]) -> None:
        """Remove pins (only keys that parse as pins), each followed by its hold."""
        for key in sorted(set(keys)):
            pin = parse_pin(key)
            if pin is None:
                raise ValueError(f"{key!r} is not a pin")
            for k in (key, hold_key(pin)):
                try:
                    await self.io.delete(k)
                except FileNotFoundError:
                    pass

    async def of(self, base: str) -> list[PinName]:
        """The pins on step ``base``."""
        listed = await self.io.list(f"{PIN_DIR}/{base}.")
        return [p for i in listed if (p := parse_pin(i.key)) is not None and p.base == base]

    async def judge(self, base: str) -> Judgement:
        """D2: what a deleter of ``base`` must keep for the pins on it (call after its tombstone).

        Per pin of save ``x`` at step ``T``: ``x`` alive there: keep everything; a manifest of ``x``
        at ``T`` whose commit stands: keep the keys of ``base`` it names; otherwise ``x`` is revoked
        at ``T`` and ``T`` read again (a commit that landed meanwhile is settled by its fence), and
        the pin is dead if no commit of ``x`` stands. A manifest at ``T`` that cannot be read keeps
        everything: it may be the only proof of a reference."""
        out = Judgement()
        for p in await self.of(base):
            out.pinners.add(p.save_id)
            if p.save_id in await self.live_saves(p.step_dir):
                log.info("step %s: save %s of step %s is alive and references it: its objects stay",
                         base, p.save_id, p.step_dir)
                out.keep_all = True
                continue
            stands = await self._standing(p)
            if stands is None:
                await self.fences.revoke(p.step_dir, [p.save_id])
                stands = await self._standing(p)  # the fence's deleter step 2: a commit since
            if stands is None:
                out.dead.append(p.key)
            elif stands is False:
                out.keep_all = True  # unreadable: kept, like every object of a damaged step
            else:
                out.keep |= stands
        return out

    async def _standing(self, p: PinName) -> set[str] | bool | None:
        """The keys of ``p.base`` that a standing commit of ``p``'s save references; None if no commit
        of that save stands at ``p.step_dir``; False if its manifest cannot be read."""
        try:
            m = await self.read_unchecked(p.step_dir)
        except FileNotFoundError:
            return None
        except (ManifestError, IntegrityError) as e:
            log.warning("step %s: the manifest of step %s, which pins it, is unreadable (%s): its objects stay",
                        p.base, p.step_dir, e)
            return False
        if m.fragments is not None:  # many hosts: each pinned under its own save id, its references in its fragment
            return await self._standing_fragment(p, m)
        if m.checkpoint_id != p.save_id or not await self.settle(p.step_dir, m):
            return None
        return referenced(m, p.base)

    async def _standing_fragment(self, p: PinName, root: Manifest) -> set[str] | bool | None:
        """:meth:`_standing` for a format-2 ``root`` at ``p.step_dir``: the pin is its host's, standing only if
        the root lists that host's fragment (a revoked host's save id fails the root's commit: ckptio.store.fence),
        and it references the keys of ``p.base`` that fragment names. Read: that one fragment, no other."""
        key = fragment_key(p.step_dir, p.save_id)
        number = next((i for i, f in enumerate(root.fragments or []) if f.key == key), None)
        if number is None or not await self.settle(p.step_dir, root):
            return None
        if not root.bases or p.base not in root.bases:
            return set()
        if self.fragment_objects is None:
            return False  # cannot tell which: kept
        try:
            keys = await self.fragment_objects(p.step_dir, root, number)
        except (FileNotFoundError, ManifestError, IntegrityError) as e:
            log.warning("step %s: fragment %s of step %s, which pins it, is unreadable (%s): its objects stay",
                        p.base, key, p.step_dir, e)
            return False
        return {k for k in keys if step_of_key(k) == p.base}

