"""Deleting a key only if it still holds what a deleter judged: the conditional delete, where there is one.

A deleter reads a small object (a manifest, a tombstone), decides from its bytes that it may go,
and deletes it. Between the read and the delete another process may replace it (a paused deleter
wakes after a delete and re-save of its step). Where the backend declares
``Capabilities.conditional_delete``, the version is taken *before* the read and the delete is
``delete_if(key, version)``: it succeeds only if that version stood from the stat to the delete,
so the bytes judged are the bytes deleted. Without it, the delete is unconditional and the window
between the read and the delete stays open (one request wide, or as long as a pause).
"""

from __future__ import annotations

from ckptio.backends import Backend

__all__ = ["delete_unchanged", "read_versioned", "version_of"]


async def version_of(io: Backend, key: str) -> str | None:
    """The version of ``key`` now ("" where ``io`` has no conditional delete); None if absent."""
    try:
        info = await io.stat(key)
    except FileNotFoundError:
        return None
    return info.version if io.capabilities.conditional_delete else ""


async def read_versioned(io: Backend, key: str) -> tuple[bytes, str]:
    """``key``'s bytes and a version no newer than them (stat, then read; "" without a conditional
    delete): :func:`delete_unchanged` of that version deletes only if these bytes still stand.
    FileNotFoundError if absent."""
    version = await version_of(io, key)
    if version is None:
        raise FileNotFoundError(f"{io.url}: {key!r}: no such object")
    return await io.read(key), version


async def delete_unchanged(io: Backend, key: str, version: str) -> bool:
    """Delete ``key`` if it is still ``version`` (unconditionally if ``version`` is ""): True if it
    went or was gone already, False if another version stands there (then nothing was deleted)."""
    try:
        if version:
            return await io.delete_if(key, version)
        await io.delete(key)
    except FileNotFoundError:
        pass
    return True
