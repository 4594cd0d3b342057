"""The names ckptio writes under a root, and the proof that a key is ckptio's.

Deleting is the most dangerous thing ckptio does, so everything that deletes
(retention, gc, the orphan sweep, tiers) deletes only keys that parse here:

* objects: ``[h<hex>/][<step>/][d<NNN>/]<save id>.h<host>-<n>`` -- exactly the
  shapes :mod:`ckptio.engine.layout`'s namings produce (hashed, flat, fan-out), no deeper,
  their numbers spelt as the layout spells them at any width (``h00003``, ``h123456``);
  a custom :class:`~ckptio.engine.layout.Naming` whose keys have another shape proves its own
  by a ``parse_object(key) -> ObjectName | None`` method (:func:`parse_object` with that
  naming asks it); without one its keys never parse (gc keeps them);
* a host's manifest fragment: ``[<step>/]ckptio.fragment.<save id>``;
* a save's intent: ``[<step>/]ckptio.intent.<save id>``, written before its
  first object and rewritten as a heartbeat while the save is in flight;
* the manifest (``ckptio.manifest.json``) and the tombstone (``ckptio.deleting``);
* a commit's fence (``[<step>/]ckptio.fence.<fence id>``) and a deleter's revocation of a dead
  save (``ckptio.revoked/<step>.<save id>``, ``-`` for the root), see :mod:`ckptio.store.fence`;
* a peer replica's marker (``<step>/ckptio.replica-of.h<host>``, see :mod:`ckptio.tiers.peer`):
  the named partner's objects of that step are all in this replica store;
* a host's commit record in a host-local tier (``<step>/ckptio.held.<checkpoint id>.h<host>``,
  see :mod:`ckptio.tiers.held`): that host's part of the checkpoint committed in the step. It
  goes with its step (deletion), and gc takes it once its step's committed manifest is another.

Anything else under a root (another tool's files, a user's notes, an Orbax
step, a nested root's deeper keys) never parses, so it is never deleted.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

from ckptio.backends.base import join_key

__all__ = [
    "INTENT_PREFIX",
    "ObjectName",
    "REPLICA_MARK_PREFIX",
    "ReplicaMark",
    "intent_key",
    "new_id",
    "is_hashed_component",
    "parse_intent",
    "parse_object",
    "parse_replica_mark",
    "FENCE_PREFIX",
    "HELD_PREFIX",
    "HeldName",
    "held_key",
    "parse_held",
    "REVOKED_DIR",
    "revoked_prefix",
    "is_fencing",
    "fence_key",
    "parse_fence",
    "parse_revoked",
    "revoked_key",
    "replica_mark_key",
    "step_of_key",
]

#: Save ids are the first 12 hex digits of a uuid4 (see :func:`new_id`).
_SID = r"[0-9a-f]{12}"
_STEP = r"0|[1-9][0-9]{0,18}"
#: HashedNaming's ``h{slot:0{chars}x}``: ``chars`` hex digits, and ``chars`` is the user's to choose.
_HASH = r"h[0-9a-f]+"
#: ``{:05d}`` of a host or an object number: five digits, or more (from 100000 on) without a leading zero.
#: Only those exact spellings: ``h000001`` or ``h1`` is a lookalike, someone else's.
_NUM5 = r"(?:[0-9]{5}|[1-9][0-9]{5,})"
#: FanoutNaming's ``d{:03d}``, likewise: a fan-out past 1000 writes ``d1000`` and on.
_FANOUT = r"d(?:[0-9]{3}|[1-9][0-9]{3,})"
_OBJECT = re.compile(
    rf"(?:(?P<hash>{_HASH})/)?(?:(?P<step>{_STEP})/)?(?:{_FANOUT}/)?(?P<sid>{_SID})\.h{_NUM5}-{_NUM5}"
)
INTENT_PREFIX = "ckptio.intent."
#: A host's part of a format-2 manifest (see ckptio.manifest.fragments), deleted with its step like an object.
_FRAGMENT = re.compile(rf"(?:(?P<step>{_STEP})/)?ckptio\.fragment\.(?P<sid>{_SID})")
_INTENT = re.compile(rf"(?:(?P<step>{_STEP})/)?ckptio\.intent\.(?P<sid>{_SID})")
_HASH_RE = re.compile(_HASH)
_SID_RE = re.compile(_SID)
_STEP_DIR_RE = re.compile(rf"(?:{_STEP})?")
REPLICA_MARK_PREFIX = "ckptio.replica-of.h"
#: Always in a step directory (a replica is of one step); the host as ``{:05d}`` writes it.
_REPLICA_MARK = re.compile(rf"(?P<step>{_STEP})/ckptio\.replica-of\.h(?P<host>[0-9]{{5,}})")
HELD_PREFIX = "ckptio.held."
#: Always in a step directory; the checkpoint id as :func:`new_id` spells it, the host as ``{:05d}``.
_HELD = re.compile(rf"(?P<step>{_STEP})/ckptio\.held\.(?P<cid>{_SID})\.h(?P<host>{_NUM5})")


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectName:
    """What a data object's key says: the step directory (``""``: the root) and the save that wrote it."""

    step_dir: str
    save_id: str


def parse_object(key: str, naming: object = None) -> ObjectName | None:
    """The step directory and save id of a ckptio data object's or fragment's key; None for any other key.

    ``naming``: the :class:`~ckptio.engine.layout.Naming` in use; a custom one whose keys have another
    shape than the built-in namings' proves its keys by its own ``parse_object(key)``. Its answer
    must name a save id as :func:`new_id` spells it, else the key is not taken as ckptio's.
    """
    m = _OBJECT.fullmatch(key) or _FRAGMENT.fullmatch(key)
    if m is not None:
        return ObjectName(m["step"] or "", m["sid"])
    own = getattr(naming, "parse_object", None)
    if own is None:
        return None
    name = own(key)
    ok = isinstance(name, ObjectName) and _SID_RE.fullmatch(name.save_id) and _STEP_DIR_RE.fullmatch(name.step_dir)
    return name if ok else None


def parse_intent(key: str) -> ObjectName | None:
    """The step directory and save id of an intent's key; None for any other key."""
    m = _INTENT.fullmatch(key)
    return None if m is None else ObjectName(m["step"] or "", m["sid"])


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaMark:
    """What a replica marker's key says: the step directory and the partner host whose objects are in."""

    step_dir: str
    host: int


def replica_mark_key(step_dir: str, host: int) -> str:
    """The marker saying that ``host``'s objects of ``step_dir`` are all in a replica store."""
    if not step_dir or isinstance(host, bool) or not isinstance(host, int) or host < 0:
        raise ValueError(f"a replica marker needs a step directory and a host >= 0, got {step_dir!r}, "
                         f"{host!r}")
    return join_key(step_dir, f"{REPLICA_MARK_PREFIX}{host:05d}")


def parse_replica_mark(key: str) -> ReplicaMark | None:
    """The step directory and host of a replica marker's key; None for any other key.

    Only the exact name :func:`replica_mark_key` writes parses (``h00001``, not
    ``h1``, ``h000001``, ``hxyz`` or ``h00001.bak``): a lookalike is someone else's.
    """
    m = _REPLICA_MARK.fullmatch(key)
    if m is None:
        return None
    mark = ReplicaMark(m["step"], int(m["host"]))
    return mark if replica_mark_key(mark.step_dir, mark.host) == key else None


@dataclasses.dataclass(frozen=True, slots=True)
class HeldName:
    """What a host's commit record's key says: its step directory, checkpoint id and host."""

    step_dir: str
    checkpoint_id: str
    host: int


def held_key(step_dir: str, checkpoint_id: str, host: int) -> str:
    """Where ``host`` records, in its host-local tier, its part of checkpoint ``checkpoint_id`` of ``step_dir``."""
    key = join_key(step_dir, f"{HELD_PREFIX}{checkpoint_id}.h{host:05d}") if step_dir else ""
    if isinstance(host, bool) or not isinstance(host, int) or parse_held(key) is None:
        raise ValueError(f"a commit record needs a step directory, a checkpoint id and a host >= 0, got "
                         f"{step_dir!r}, {checkpoint_id!r}, {host!r}")
    return key


def parse_held(key: str) -> HeldName | None:
    """The step directory, checkpoint id and host of a commit record's key; None for any other key.

    Only the exact spelling :func:`held_key` writes parses (``h00001``, not ``h1``; no suffix).
    """
    m = _HELD.fullmatch(key)
    return None if m is None else HeldName(m["step"], m["cid"], int(m["host"]))


def new_id() -> str:
    """A fresh save (or fence) id: the 12 hex digits every object, intent and fence name carries."""
    return uuid.uuid4().hex[:12]


def intent_key(step_dir: str, save_id: str) -> str:
    """Where a save announces itself: beside the manifest it will commit."""
    return join_key(step_dir, INTENT_PREFIX + save_id)


def is_hashed_component(name: str) -> bool:
    """True for a hashed first component (``h3f``) of an object-store layout."""
    return _HASH_RE.fullmatch(name) is not None


def step_of_key(key: str) -> str | None:
    """The step directory a manifest's object key lies in (``""``: the root), whatever its file name.

    Looser than :func:`parse_object` on purpose: it binds older keys to their
    step too. None for a key that is not under one step directory.
    """
    parts = key.split("/")
    if len(parts) > 1 and is_hashed_component(parts[0]):
        parts = parts[1:]
    if len(parts) > 1 and parts[0].isdigit() and str(int(parts[0])) == parts[0]:
        return parts[0]
    if parts[0].isdigit():
        return None  # a bare number as a file name: not a layout ckptio writes
    return ""


#: Revocations (see :mod:`ckptio.store.fence`) live in one folder at the root, not in the step directories:
#: a revocation is kept forever (a revoked save may wake at any time), while a step's directory
#: goes with its step.
REVOKED_DIR = "ckptio.revoked"
FENCE_PREFIX = "ckptio.fence."
_REVOKED = re.compile(rf"{REVOKED_DIR}/(?P<step>{_STEP}|-)\.(?P<sid>{_SID})")
_FENCE = re.compile(rf"(?:(?P<step>{_STEP})/)?ckptio\.fence\.(?P<sid>{_SID})")


def revoked_prefix(step_dir: str) -> str:
    """The prefix of every revocation of ``step_dir`` (``-``: the root; one listing finds them all)."""
    return f"{REVOKED_DIR}/{step_dir or '-'}."


def revoked_key(step_dir: str, save_id: str) -> str:
    """Where a deleter revokes ``save_id``'s objects of ``step_dir``: created once, never removed."""
    return revoked_prefix(step_dir) + save_id


def fence_key(step_dir: str, fence_id: str) -> str:
    """The key whose single creation decides whether the commit ``fence_id`` of ``step_dir`` stands
    (beside the manifest: it goes with its step)."""
    return join_key(step_dir, FENCE_PREFIX + fence_id)


def parse_revoked(key: str) -> ObjectName | None:
    """The step directory and save id of a revocation's key; None for any other key."""
    m = _REVOKED.fullmatch(key)
    return None if m is None else ObjectName("" if m["step"] == "-" else m["step"], m["sid"])


def parse_fence(key: str) -> ObjectName | None:
    """The step directory and fence id of a fence's key; None for any other key."""
    m = _FENCE.fullmatch(key)
    return None if m is None else ObjectName(m["step"] or "", m["sid"])


def is_fencing(key: str) -> bool:
    """True for a commit's fence or a revocation (bookkeeping of :mod:`ckptio.store.fence`, not data)."""
    return parse_fence(key) is not None or parse_revoked(key) is not None
