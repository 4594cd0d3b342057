"""A save's intent, announced before its first object and kept fresh while it is in flight.

Whatever deletes (gc, retention, a re-save's cleanup) spares every object of
a save whose intent is live -- heartbeat younger than its lease -- whatever
the objects' age; so a slow save is never mistaken for a crashed one. A save
that dies stops beating: its intent goes stale after the lease and its
objects become orphans that gc (and the deletion of that step) remove.

:class:`Intents` reads and writes intents (``<step>/ckptio.intent.<save id>``); a writer
announces and keeps one fresh through its write transaction (:mod:`ckptio.store.transaction`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

from ckptio.backends.base import ObjectInfo, join_key
from ckptio.manifest.names import INTENT_PREFIX, intent_key, new_id, parse_intent
from ckptio.store.context import StoreContext
from ckptio.store.options import DEFAULT_LEASE_S

__all__ = ["Intents", "new_id"]

log = logging.getLogger("ckptio.intents")


class Intents:
    """The intents of one store."""

    def __init__(self, ctx: StoreContext) -> None:
        self.ctx = ctx

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
        await self.ctx.io.write(intent_key(step_dir, save_id), [memoryview(json.dumps(doc).encode())])

    async def retire(self, step_dir: str, save_id: str) -> None:
        """Remove a save's intent (after its commit, or its failure)."""
        await self.ctx.delete_keys([intent_key(step_dir, save_id)])

    async def live_saves(self, step_dir: str, listing: list[ObjectInfo] | None = None) -> set[str]:
        """Save ids with a live intent in ``step_dir`` (heartbeat younger than its lease).

        ``listing``: the step's intents as already listed (others in it are ignored).
        """
        if listing is None:
            listing = await self.ctx.io.list(join_key(step_dir, INTENT_PREFIX))
        live: set[str] = set()
        for info in listing:
            name = parse_intent(info.key)
            if name is not None and name.step_dir == step_dir:
                live |= await self._intent_covers(info, name.save_id)
        return live

    async def others_than(self, step_dir: str, writers: set[str]) -> bool:
        """True if intents of saves other than ``writers`` remain in ``step_dir`` (live or not)."""
        listed = await self.ctx.io.list(join_key(step_dir, INTENT_PREFIX))
        return any((n := parse_intent(i.key)) is not None and n.save_id not in writers for i in listed)

    async def _intent_covers(self, info: ObjectInfo, save_id: str) -> set[str]:
        """The save ids a live intent protects (none once its heartbeat is older than its lease).

        An intent retired while we look protects its ids this round (its save just committed);
        an unreadable one protects at least its own id.
        """
        try:
            doc = json.loads(await self.ctx.io.read(info.key))
            lease = float(doc.get("lease_s", DEFAULT_LEASE_S))
            covers = {save_id, *(c for c in doc.get("covers", []) if isinstance(c, str))}
            if doc.get("hold"):  # for older ckptio only (ckptio.store.pins): pins decide here
                return set()
        except FileNotFoundError:
            return {save_id}
        except (ValueError, TypeError, AttributeError):
            lease, covers = DEFAULT_LEASE_S, {save_id}
        return covers if time.time() - info.mtime < lease else set()
