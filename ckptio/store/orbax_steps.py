"""Orbax step directories as ckptio sees them, without importing Orbax or jax.

A root written through :mod:`ckptio.orbax` holds Orbax step directories, not
ckptio steps: ``<root>/<step>/`` has Orbax's ``_CHECKPOINT_METADATA`` (and
``commit_success.txt``) and one directory per item; an item saved with
``ckptio.orbax.Save`` is a ckptio checkpoint at the item directory itself, or
a pointer (:data:`POINTER_NAME`) to one in external storage. Orbax commits
such a step, not ckptio's manifest at the step level, so ``ckptio ls`` asks
:func:`orbax_step` what a step directory without a manifest is before it
calls it a crashed save's leftovers.

This module is ckptio.orbax's source of the names and the pointer format (it
imports jax and Orbax; ``ckptio ls`` must run without them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

from ckptio.backends.base import Backend, join_key
from ckptio.errors import CheckpointNotFoundError
from ckptio.manifest import MANIFEST_NAME, ArrayItem, Manifest

__all__ = [
    "COMMIT_SUCCESS_NAME", "HANDLER", "POINTER_FORMAT", "POINTER_NAME", "STEP_METADATA_NAME", "TMP_SUFFIX",
    "OrbaxItem", "OrbaxStep", "final_name", "orbax_step", "pointer_at",
]

#: In an Orbax item directory: where the item's ckptio checkpoint lives when it is external.
POINTER_NAME = "ckptio.orbax.json"
POINTER_FORMAT = "ckptio-orbax-pointer"
_MAX_POINTER_BYTES = 1 << 16
#: Orbax's suffix of directories not yet committed (orbax.checkpoint._src.path.atomicity_types).
TMP_SUFFIX = ".orbax-checkpoint-tmp"
#: Orbax's step metadata (orbax.checkpoint._src.metadata.checkpoint), written into every step it saves.
STEP_METADATA_NAME = "_CHECKPOINT_METADATA"
#: What finalises a step where Orbax cannot rename atomically (GCS), and what it also writes elsewhere
#: (orbax.checkpoint._src.path.atomicity_types.COMMIT_SUCCESS_FILE).
COMMIT_SUCCESS_NAME = "commit_success.txt"
#: The handler that ``_CHECKPOINT_METADATA`` names for an item saved with ``ckptio.orbax.Save``.
HANDLER = "ckptio.orbax.handler.CkptioCheckpointHandler"


def final_name(name: str) -> str:
    """A directory's name once Orbax commits it (``state.orbax-checkpoint-tmp`` -> ``state``)."""
    i = name.find(TMP_SUFFIX)
    return name if i < 0 else name[:i]


async def pointer_at(store: StepSource, item_key: str, where: str) -> dict[str, Any] | None:
    """The pointer in the item directory ``item_key`` of ``store`` ("": its root), or None.

    CheckpointNotFoundError names ``where`` for a pointer that is not one (too large, not
    ours, or naming an item that could escape the storage root).
    """
    key = join_key(item_key, POINTER_NAME)
    try:
        size = (await store.io.stat(key)).size
        if size > _MAX_POINTER_BYTES:  # checked before reading: never load a huge file
            raise CheckpointNotFoundError(f"{where} is not a valid ckptio pointer: {size} bytes")
        data = await store.io.read(key)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != POINTER_FORMAT or doc.get("version") != 1:
            raise ValueError(f"unknown format {doc.get('format')!r} version {doc.get('version')!r}")
        for field in ("storage", "item"):
            if not isinstance(doc.get(field), str) or not doc[field]:
                raise ValueError(f"{field!r} is not a non-empty string")
        if "/" in doc["item"] or doc["item"] in (".", ".."):
            raise ValueError(f"item {doc['item']!r} is not a directory name")  # it must not escape the root
        if not isinstance(doc.get("step"), int) or doc["step"] < 0:
            raise ValueError("'step' is not a non-negative int")
    except ValueError as e:
        raise CheckpointNotFoundError(f"{where} is not a valid ckptio pointer: {e}") from None
    return doc


class StepSource(Protocol):
    """What reading Orbax steps needs of a store (``ckptio.store.CheckpointStore`` is one).

    A protocol, not the class: the store's catalog asks this module about Orbax steps,
    so importing the store here would close a cycle.
    """

    @property
    def url(self) -> str: ...
    @property
    def backend(self) -> Backend: ...
    @property
    def io(self) -> Backend: ...
    def where(self, step_dir: str) -> str: ...
    def sibling(self, url: str) -> StepSource: ...
    async def status(self, step_dir: str) -> Any: ...
    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """One item of an Orbax step: its handler and, for a ckptio item, its checkpoint's state."""

    name: str
    #: The handler ``_CHECKPOINT_METADATA`` names (its class name alone); "" if it names none.
    handler: str
    #: A ckptio item's checkpoint: its store's URL and step (None: the item directory itself).
    url: str | None = None
    step: int | None = None
    #: A ckptio item's :class:`ckptio.store.StepStatus` state; "" for another handler's item.
    state: str = ""
    problem: str = ""
    manifest: Manifest | None = None

    @property
    def is_ckptio(self) -> bool:
        return self.url is not None or self.handler == HANDLER.rpartition(".")[2]


@dataclasses.dataclass(frozen=True)
class OrbaxStep:
    """An Orbax step directory: finalised by Orbax or not, and its items."""

    finalized: bool
    items: tuple[OrbaxItem, ...]
    #: When Orbax committed it (its step metadata), in seconds; None if it does not say.
    committed_at: float | None = None

    @property
    def state(self) -> str:
        """``committed``; ``unfinalized`` (Orbax has not committed it); ``damaged`` (a ckptio item is not)."""
        if not self.finalized:
            return "unfinalized"
        return "damaged" if self.problem else "committed"

    @property
    def problem(self) -> str:
        if not self.finalized:
            return (f"Orbax has not finalised this step (no {COMMIT_SUCCESS_NAME}): a save in flight, or one "
                    "that died; Orbax removes it, `ckptio gc` leaves it alone")
        for it in self.items:
            if it.is_ckptio and it.state != "committed":
                what = f"{it.url} step {it.step}" if it.step is not None else it.url or "its directory"
                why = it.problem or ("not committed (no manifest)" if it.state == "incomplete" else it.state)
                return f"item {it.name!r} (ckptio checkpoint at {what}): {why}"
        return ""

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for it in self.items if it.manifest is not None
                   for i in it.manifest.items.values() if isinstance(i, ArrayItem))


def _commits_by_file(url: str) -> bool:
    """True where Orbax finalises a step by writing its commit file, not by an atomic rename.

    Orbax picks that for GCS paths (atomicity_defaults.get_default_temporary_path_class): there a
    step directory has its final name while it is being written.
    """
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return scheme.removeprefix("fsspec+") in ("gs", "gcs")


async def orbax_step(store: StepSource, step_dir: str) -> OrbaxStep | None:
    """What the step directory ``step_dir`` of ``store`` is if Orbax saved it; None if it is not Orbax's.

    One listing of the step directory, a read of Orbax's step metadata, and each ckptio
    item's :meth:`~ckptio.store.CheckpointStore.status` (a manifest read and a listing).
    """
    base = step_dir + "/"
    listing = await store.io.list(base)
    rel = {i.key[len(base):] for i in listing}
    files = {r for r in rel if "/" not in r}
    if STEP_METADATA_NAME not in files and COMMIT_SUCCESS_NAME not in files:
        return None
    meta: Any = {}
    if STEP_METADATA_NAME in files:
        key = join_key(step_dir, STEP_METADATA_NAME)
        try:
            meta = json.loads(await store.io.read(key))
        except (FileNotFoundError, ValueError):
            meta = {}  # Orbax's own metadata; the step's items still say what they are
    meta = meta if isinstance(meta, dict) else {}
    handlers = meta.get("item_handlers")
    handlers = handlers if isinstance(handlers, dict) else {}
    names = sorted({r.split("/", 1)[0] for r in rel if "/" in r}
                   | {n for n in handlers if isinstance(n, str)})
    items = tuple([await _item(store, step_dir, n, str(handlers.get(n) or ""), rel) for n in names])
    stamp = meta.get("commit_timestamp_nsecs")
    committed_at = stamp / 1e9 if isinstance(stamp, (int, float)) and stamp > 0 else None
    finalized = COMMIT_SUCCESS_NAME in files or not _commits_by_file(store.url)
    return OrbaxStep(finalized, items, committed_at)


async def _item(store: StepSource, step_dir: str, name: str, handler: str, rel: set[str]) -> OrbaxItem:
    """The item ``name`` of the Orbax step ``step_dir``; ``rel``: the step's keys, relative to it."""
    short = handler.rpartition(".")[2]
    item_key = join_key(step_dir, name)
    where = store.where(item_key)
    url: str | None = None
    step: int | None = None
    if f"{name}/{POINTER_NAME}" in rel:
        try:
            ptr = await pointer_at(store, item_key, f"{where}/{POINTER_NAME}")
        except CheckpointNotFoundError as e:
            return OrbaxItem(name, short, where, None, "damaged", str(e))
        if ptr is None:  # deleted since the listing
            return OrbaxItem(name, short, where, None, "damaged", f"{where}/{POINTER_NAME} vanished")
        url, step = f"{ptr['storage'].rstrip('/')}/{ptr['item']}", ptr["step"]
    elif f"{name}/{MANIFEST_NAME}" in rel:
        url = where
    elif handler == HANDLER:
        return OrbaxItem(name, short, where, None, "damaged",
                         f"no {MANIFEST_NAME} and no {POINTER_NAME} in {where}: its data is gone")
    else:
        return OrbaxItem(name, short)
    try:
        inner = store.sibling(url)
    except ValueError as e:  # a pointer naming storage this process has no backend for
        return OrbaxItem(name, short, url, step, "damaged", str(e))
    try:
        st = await inner.status("" if step is None else str(step))
    finally:
        await inner.close()
    return OrbaxItem(name, short, url, step, st.state, st.problem, st.manifest)
