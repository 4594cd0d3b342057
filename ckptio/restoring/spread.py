"""Fan-out over several senders: the bands of a shard few hosts send, sent by several hosts.

In a logical-box exchange (:mod:`ckptio.restoring.boxexchange`) the stored
shards of fragment ``f`` are read and sent by host ``f % H``. An array whose
shards lie in fewer fragments than there are hosts -- a replicated array,
saved whole by one host -- is then read by one host, which sends all of it to
the ``H - 1`` others: one NIC carries ``array * (H - 1)`` bytes. The exchange
already cuts a large array's shards into row bands, one band a round (the
same on both ends); here band ``k`` of such an array's shard is sent by host
``(f % H + k) % H`` instead, so ``B`` bands have ``B`` readers, each reading
its band once and sending it: about ``array / B * (H - 1)`` bytes a host.
Bands already cut where reads meet (a checksum block at a band's edge is read
for both bands however many hosts read them), so the storage bytes read do
not grow. Which arrays spread, and over how many bands, both ends decide alike
from the root and the target tables (:func:`spread_bands`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from ckptio.manifest import ArrayItem, Manifest
from ckptio.manifest.table import table_of
from ckptio.restoring.boxroute import Pieces, TargetTable

__all__ = ["may_send", "original_senders", "received", "sent", "spread_bands", "spread_fragments"]

_I64 = np.int64


def _fragments(item: ArrayItem) -> np.ndarray:
    """Per stored shard, its fragment (format 1: shard ``i`` as if in fragment ``i``)."""
    if item.locator is not None:
        return np.asarray(item.locator[:, 0], _I64)
    return np.arange(len(table_of(item).offsets), dtype=_I64)


def spread_bands(root: Manifest, tables: Mapping[str, TargetTable], bands: Mapping[str, int],
                 hosts: int) -> dict[str, int]:
    """The arrays of ``tables`` cut into several ``bands`` whose shards fewer than ``hosts`` hosts
    would send, and their bands: each band of their shards is sent by another host. Arrays sharing
    a locator (one layout) are looked at once: a pass over its rows, no sort."""
    out, few = {}, {}
    for name in tables:
        item, b = root.items.get(name), bands.get(name, 1)
        if not isinstance(item, ArrayItem) or b < 2 or (not root.complete and item.locator is None):
            continue  # one band, or shards the root holds itself (sent as before)
        key = id(item.locator) if item.locator is not None else name
        if key not in few:
            senders = np.zeros(hosts, bool)
            senders[_fragments(item) % hosts] = True
            few[key] = not senders.all()
        if few[key]:
            out[name] = b
    return out


def may_send(src: np.ndarray, bands: int, rank: int, hosts: int) -> np.ndarray:
    """Which pieces of original senders ``src`` host ``rank`` sends in some band ``k < bands``
    (band ``k`` of sender ``s``'s shards is sent by ``(s + k) % hosts``)."""
    return (rank - np.asarray(src, _I64)) % hosts < bands


def spread_fragments(root: Manifest, spread: Mapping[str, int], rank: int, hosts: int) -> set[int]:
    """The fragments holding shards of ``spread`` arrays whose bands host ``rank`` sends."""
    out: set[int] = set()
    done: set[tuple[int, int]] = set()
    for name, b in spread.items():
        item = root.items[name]
        key = (id(item.locator), b)  # type: ignore[union-attr]
        if key in done:
            continue
        done.add(key)
        frags = _fragments(item)  # type: ignore[arg-type]
        held = np.zeros(int(frags.max()) + 1 if len(frags) else 0, bool)
        held[frags] = True
        frags = np.flatnonzero(held)
        out.update(frags[may_send(frags % hosts, b, rank, hosts)].tolist())
    return out


def original_senders(loaded: ArrayItem, root_item: ArrayItem, rank: int, hosts: int) -> np.ndarray:
    """Per row of ``table_of(loaded)`` (shards of a root with some fragments loaded), the host
    that sends it unspread: its fragment (found by its box in the root's locator) ``% hosts``;
    ``rank`` for the shards of an item the root holds itself (no locator)."""
    t, loc = table_of(loaded), root_item.locator
    if loc is None:
        return np.full(len(t.offsets), rank, _I64)
    if len(loc) == 1:
        return np.full(len(t.offsets), int(loc[0, 0]) % hosts, _I64)
    keys = np.ascontiguousarray(loc[:, 1:], _I64)
    void = np.dtype((np.void, keys.dtype.itemsize * keys.shape[1]))
    keys = keys.view(void).ravel()
    order = np.argsort(keys, kind="stable")
    mine = np.ascontiguousarray(np.hstack([t.offsets, t.shape]), _I64).view(void).ravel()
    at = np.minimum(np.searchsorted(keys[order], mine), len(keys) - 1)
    if not (keys[order][at] == mine).all():
        raise ValueError("a loaded shard is not in the root's locator")
    return np.asarray(loc[order[at], 0], _I64) % hosts


def sent(p: Pieces, shift: int, rank: int, hosts: int) -> Pieces:
    """Of one band's pieces ``p`` (``src``: their original senders), those host ``rank`` sends
    when the band is sent ``shift`` hosts on; ``src`` set to ``rank``."""
    out = p.take((p.src + shift) % hosts == rank)
    return dataclasses.replace(out, src=np.full(len(out), rank, _I64))


def received(p: Pieces, shift: int, hosts: int) -> Pieces:
    """One band's pieces ``p`` a host receives, from the host that sends them ``shift`` hosts on."""
    return dataclasses.replace(p, src=(p.src + shift) % hosts) if shift else p
