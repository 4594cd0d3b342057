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

A copy (``ckptio cp``) carries a companion byte for byte (:func:`carried`,
:func:`write_companions`): its paths are relative to the step directory, so it
stays right wherever the objects keep their names relative to the step (a
copy between POSIX roots, to another step number). Where they do not (a
hashed object store, objects renamed for a revoked save id) the copy's
manifest drops the record instead: ckptio never unpickles the file to
rewrite it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Protocol

from ckptio.backends.base import join_key
from ckptio.manifest import Manifest

__all__ = ["carried", "companions_of", "create_companion", "delete_companions", "is_companion", "without_others",
           "write_companions"]

log = logging.getLogger("ckptio.store")

#: Names a companion may have (a plain file name in the step directory, never a path).
_NAMES = frozenset({".metadata"})


class _Store(Protocol):
    io: Any

    def where(self, step_dir: str) -> str: ...


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


def _is_recorded(data: bytes, entry: dict[str, Any]) -> bool:
    """Whether ``data`` is exactly the bytes ``entry`` records."""
    return len(data) == entry["size"] and hashlib.sha256(data).hexdigest() == entry["sha256"]


async def _matches(store: _Store | _Deleter, key: str, entry: dict[str, Any]) -> bool | None:
    """Whether the file at ``key`` has exactly the bytes ``entry`` records (None: there is no file)."""
    try:
        data = bytes(await store.io.read(key))
    except FileNotFoundError:
        return None
    return _is_recorded(data, entry)


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


def _relative(keys: list[str], step_dir: str) -> list[str] | None:
    """``keys`` relative to ``step_dir`` (None if one lies outside it)."""
    prefix = f"{step_dir}/" if step_dir else ""
    if not all(k.startswith(prefix) for k in keys):
        return None
    return [k[len(prefix):] for k in keys]


async def carried(src: _Store, step_dir: str, manifest: Manifest, dst: _Store, dst_dir: str,
                  dst_manifest: Manifest) -> dict[str, bytes]:
    """The companions of ``src``'s ``step_dir`` a copy to ``dst_manifest`` in ``dst_dir`` carries, name -> bytes.

    A companion is carried when the source file still has its recorded bytes and every object keeps
    its name relative to the step (the companion's paths then name the copied objects). Raises
    FileExistsError if ``dst_dir`` already holds a file of that name with other bytes (another tool's
    checkpoint there: neither overwritten nor left beside ours to be misread).
    """
    names = _relative(manifest.objects, step_dir)
    same_names = names is not None and names == _relative(dst_manifest.objects, dst_dir)
    out: dict[str, bytes] = {}
    for entry in companions_of(manifest):
        there = await _matches(dst, join_key(dst_dir, entry["name"]), entry)
        if there is False:
            raise FileExistsError(f"{dst.where(dst_dir)} holds a {entry['name']} ckptio did not write there "
                                  "(another tool's checkpoint?): copy elsewhere or remove it first")
        try:
            data = bytes(await src.io.read(join_key(step_dir, entry["name"])))
        except FileNotFoundError:
            data = b""
        if not same_names or not _is_recorded(data, entry):
            log.warning("%s: %s not carried to %s (%s); stock torch cannot read the copy, ckptio can",
                        src.where(step_dir), entry["name"], dst.where(dst_dir),
                        "the objects are renamed there" if not same_names else "the source file is not ours")
            continue
        out[entry["name"]] = data
    return out


def without_others(manifest: Manifest, names: Any) -> Manifest:
    """``manifest`` recording only the companions in ``names`` (a copy's manifest claims no file it lacks)."""
    dcp = manifest.metadata.get("dcp") if isinstance(manifest.metadata, dict) else None
    if not isinstance(dcp, dict) or "companions" not in dcp:
        return manifest
    kept = [e for e in companions_of(manifest) if e["name"] in names]
    dcp = {k: v for k, v in dcp.items() if k != "companions"} | ({"companions": kept} if kept else {})
    return dataclasses.replace(manifest, metadata={**manifest.metadata, "dcp": dcp})


async def write_companions(dst: _Store, dst_dir: str, companions: dict[str, bytes]) -> None:
    """Write the carried companions in ``dst_dir`` (after the copy's commit: torch never reads a
    ``.metadata`` whose objects are not committed), each by :func:`create_companion`."""
    for name, data in companions.items():
        await create_companion(dst, dst_dir, name, data)


async def create_companion(dst: _Store, dst_dir: str, name: str, data: bytes) -> bool:
    """Create companion ``name`` in ``dst_dir`` after its save's commit, only where no file of that
    name is; True if it holds ``data`` now.

    A writer paused after its commit (a copy, a ``ckptio.dcp.Writer``) may wake after its step was
    deleted and saved again: the newer checkpoint's own ``.metadata`` must stay (a file with other
    bytes there is left, logged). What stays open: the step deleted and not saved again as a DCP
    step -- the late file is then a stray its step's deletion leaves (nothing records it), and a
    later ``ckptio.dcp.Writer`` there refuses it as a stock checkpoint.
    """
    key = join_key(dst_dir, name)
    try:
        await dst.io.create_if_absent(key, data)
    except FileExistsError:
        if bytes(await dst.io.read(key)) != data:
            log.warning("%s: %s not written: a file of that name is there already (a newer checkpoint's?), "
                        "left as it is", dst.where(dst_dir), name)
            return False
    return True
