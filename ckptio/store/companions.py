"""Files a save writes beside its manifest for other tools (stock torch's ``.metadata``), and how they go.

``ckptio.dcp.Writer`` makes a checkpoint on a local path readable by stock
torch by writing DCP's ``.metadata`` next to ``ckptio.manifest.json``
(:mod:`ckptio.dcp._torchsave`). ckptio never reads such a file; its manifest
lists it under ``metadata["dcp"]["companions"]`` as
``{"name": ".metadata", "size": n, "sha256": "..."}``. That record is the
proof of ownership deletion needs: a companion is deleted only if the file
at that name, in the manifest's own step directory, still has exactly those
bytes (anything else there -- a user's file, another tool's -- is left).

Order: a companion is written after its manifest commits and deleted before
any object its manifest names, so whoever reads it (torch) never finds it
pointing at data ckptio has started to delete.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol

from ckptio.backends.base import join_key

from ..manifest import Manifest

__all__ = ["companions_of", "delete_companions", "is_companion"]

log = logging.getLogger("ckptio.store")

#: Names a companion may have (a plain file name in the step directory, never a path).
_NAMES = frozenset({".metadata"})


class _Deleter(Protocol):
    io: Any

    async def delete_keys(self, keys: Any) -> None: ...


def companions_of(manifest: Manifest) -> list[dict[str, Any]]:
    """The well-formed companion records of ``manifest`` (others are ignored: they prove nothing)."""
    dcp = manifest.metadata.get("dcp") if isinstance(manifest.metadata, dict) else None
    entries = dcp.get("companions") if isinstance(dcp, dict) else None
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and e.get("name") in _NAMES
            and type(e.get("size")) is int and isinstance(e.get("sha256"), str)]


async def _matches(store: _Deleter, key: str, entry: dict[str, Any]) -> bool | None:
    """Whether the file at ``key`` has exactly the bytes ``entry`` records (None: there is no file)."""
    try:
        data = bytes(await store.io.read(key))
    except FileNotFoundError:
        return None
    return len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"]


async def is_companion(store: _Deleter, step_dir: str, manifest: Manifest, name: str) -> bool:
    """True if ``step_dir/name`` is a companion ``manifest`` records, with its recorded bytes (not another
    tool's file saved over it)."""
    return any([await _matches(store, join_key(step_dir, name), e) for e in companions_of(manifest)
                if e["name"] == name])


async def delete_companions(store: _Deleter, step_dir: str, manifest: Manifest, where: str) -> list[str]:
    """Delete ``manifest``'s companions in ``step_dir`` whose bytes still match its record; the keys deleted."""
    doomed = []
    for entry in companions_of(manifest):
        key = join_key(step_dir, entry["name"])
        same = await _matches(store, key, entry)
        if same is False:
            log.warning("%s: %s is not the file this checkpoint's save wrote (its bytes differ); left alone",
                        where, entry["name"])
        if same:
            doomed.append(key)
    await store.delete_keys(doomed)
    return doomed
