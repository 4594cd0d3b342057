"""Shadows: the host copies of what the last committed save wrote, so that the next save finds an
unchanged shard by a byte compare instead of a digest (docs/incremental.md, section 1).

An incremental manager keeps, for each array shard its last save staged as a private copy, that
very staging buffer (the bytes its object was written from, and its crc32c blocks computed from)
instead of handing it back to the staging pool. The next save compares the caller's array with it
(``memcmp``: ~5-10 GB/s on one core here, against 0.6-1.6 GB/s for sha256, and it stops at the
first differing byte), on the caller's thread, where the array is stable. Equal bytes need no
digest and no copy: a crc collision cannot alias different bytes, as no crc decides anything.

The invariant that makes a shadow a proof: **the shadow of (item, box) holds exactly the bytes
that the committed manifest :attr:`Shadows.cid` records for that shard.** It holds because

* a shadow is only ever a buffer this save's staging area owned and copied the caller's bytes
  into (never a view of the caller's memory, which may change), taken out of the area so nothing
  else fills it again, and installed only once the save that wrote it committed (:meth:`settle`,
  with the committed manifest's checkpoint id);
* a shard reused by a byte compare keeps its shadow: the new manifest records the base's extents
  for it, the same bytes;
* anything else -- a failed save, a commit of another id, an item dropped from the state -- drops
  the shadows it touches; the next save then writes those shards (or digests them).

The cost is memory: between saves the manager holds one host copy of the state it staged (a save
that changes everything holds it beside the pool's buffers: up to twice a full save's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ckptio.manifest import Manifest
from ckptio.manifest.model import Box
from ckptio.saving.incremental.compare import equal_pairs, same_bytes
from ckptio.saving.incremental.reuse import ShardKey
from ckptio.saving.staging import StagingArea
from ckptio.state.leaves import StagedArray
from ckptio.system.bufferpool import StagingPool

__all__ = ["ShardKey", "Shadows", "same_bytes"]

@dataclasses.dataclass
class _Held:
    data: np.ndarray  # the shard's bytes, C order (a view of ``buffer``)
    buffer: np.ndarray  # the staging buffer it lives in, given back to ``pool`` when dropped
    pool: StagingPool | None


@dataclasses.dataclass
class _Offer:
    save_id: str
    kept: set[ShardKey]  # shards the save reused by a byte compare: their shadows stay
    taken: dict[ShardKey, _Held]  # shards it wrote from private copies: their new shadows


class Shadows:
    """One manager's shadows (the invariant: this module's docstring). Not thread-safe: the
    manager runs one save at a time, and only its save's thread offers, after the writes."""

    def __init__(self) -> None:
        self._held: dict[ShardKey, _Held] = {}
        self._cid: str | None = None
        self._offer: _Offer | None = None

    @property
    def cid(self) -> str | None:
        """The checkpoint id of the committed manifest whose records the shadows hold."""
        return self._cid

    def __len__(self) -> int:
        return len(self._held)

    def unchanged(self, base: Manifest | None, name: str, box: Box, source: np.ndarray) -> bool:
        """Whether ``source`` (the caller's bytes of shard ``box`` of item ``name``) equals what
        ``base`` records for it, as its shadow proves (False without one for ``base``)."""
        return (name, box) in self.unchanged_many(base, {(name, box): source})

    def unchanged_many(self, base: Manifest | None, sources: Mapping[ShardKey, np.ndarray]) -> set[ShardKey]:
        """The shards of ``sources`` (the caller's bytes by item and box) whose bytes equal what
        ``base`` records for them, as their shadows prove: compared all at once (:mod:`.compare`)."""
        if base is None or base.checkpoint_id != self._cid:
            return set()
        pairs = {k: (self._held[k].data, src) for k, src in sources.items() if k in self._held}
        return equal_pairs(pairs)  # type: ignore[return-value]

    def offer(self, save_id: str, kept: Iterable[ShardKey], private: Iterable[ShardKey],
              staged: dict[str, Any], area: StagingArea) -> None:
        """Take the private staging copies of the ``private`` shards out of ``area`` (called once
        they are written, before the area is released): the shadows of save ``save_id``, which
        become the shadows at :meth:`settle` if it commits."""
        self._discard_offer()
        owned = {b.ctypes.data: b for b in area.owned if b.nbytes}
        taken: dict[ShardKey, _Held] = {}
        for name, box in private:
            item = staged.get(name)
            if not isinstance(item, StagedArray):
                continue
            for offsets, shape, data in item.shards:
                if (tuple(offsets), tuple(shape)) != box or not data.nbytes:
                    continue
                buf = owned.pop(data.ctypes.data, None)
                if buf is not None and buf.nbytes >= data.nbytes:
                    taken[(name, box)] = _Held(data, buf, area.pool)
        ids = {id(h.buffer) for h in taken.values()}
        area.owned = [b for b in area.owned if id(b) not in ids]  # never given back, never filled again
        self._offer = _Offer(save_id, set(kept), taken)

    def settle(self, manifest: Manifest | None) -> None:
        """The outcome of the last save: ``manifest``, the one it committed (None: it failed).
        The shadows then hold ``manifest``'s records, or none where that cannot be proven."""
        offer, self._offer = self._offer, None
        if manifest is None or offer is None or offer.save_id != manifest.checkpoint_id:
            if offer is not None:
                _give_back(offer.taken.values())
            self.drop()
            return
        held = {k: self._held[k] for k in offer.kept if k in self._held}
        held.update(offer.taken)
        _give_back(h for k, h in self._held.items() if held.get(k) is not h)
        self._held, self._cid = held, manifest.checkpoint_id

    def drop(self) -> None:
        """Forget every shadow (their buffers go back to their pools)."""
        self._discard_offer()
        _give_back(self._held.values())
        self._held, self._cid = {}, None

    def _discard_offer(self) -> None:
        if self._offer is not None:
            _give_back(self._offer.taken.values())
            self._offer = None


def _give_back(held: Iterable[_Held]) -> None:
    for h in held:
        if h.pool is not None:
            h.pool.give_back([h.buffer])
