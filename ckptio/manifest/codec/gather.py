"""Columnar fragments' rows gathered as they are read: one set of columns, filled in place.

A host planning a column block of every array of a 4096-host job reads every
fragment; holding each fragment's decoded columns until the last one is read,
then copying them all into one set, held both at once (and the heap kept the
first copy's pages). :class:`Gather` takes each fragment's rows (the items a
reader restores) as it is decoded and copies them at once into columns that
grow in place, sized from the first fragment times the fragments expected, so
the reader holds one set of columns and one fragment's bytes at a time.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.codec.columns import Columns, _ranges, _take_rows, _widened
from ckptio.manifest.codec.wholes import Wholes

__all__ = ["Gather"]

_ROW_COLS = ("item", "frag", "boxes", "ecount")
#: At most this much address space is reserved on the first fragment's guess.
_GUESS_BYTES = 1 << 30


class Gather:
    """The rows of items ``names`` (None: all) of the fragments :meth:`add` is given, as one set of
    columns (:meth:`done`): ``item`` (index into ``arrays``), ``frag``, ``boxes`` (widened to the
    widest rank), ``ecount``, ``extents`` (objects made global), ``crcs``, and ``loaded``: the
    fragment numbers added. ``expect``: how many fragments will come (None: unknown)."""

    def __init__(self, arrays: list[str], names: Collection[str] | None, expect: int | None = None) -> None:
        self.ids = {n: i for i, n in enumerate(arrays)}
        self.names, self.expect = names, expect
        # Every host lists the same items with the same counts (decode_columns then shares one
        # dict): the item index of those rows, and which of them are wanted, are worked out once.
        self.known: dict[int, tuple[np.ndarray, Any, Columns]] = {}
        self.loaded: list[int] = []
        self.width = 0
        self.at = [0, 0, 0]  # rows, extents, checksums filled
        self.cols: dict[str, np.ndarray] = {}

    def add(self, f: int, base: int, c: Columns) -> None:
        """Fragment ``f``'s rows (its objects numbered from ``base``); ``c`` is emptied."""
        item, rows = self._rows_of(c)
        boxes, ecount, ext, crcs = c.take()
        if not isinstance(rows, slice):
            boxes, ecount, ext, crcs = _take_rows((boxes, ecount, ext, crcs), rows)
        if len(ext) and (ext[:, 0].min() < 0 or ext[:, 0].max() >= c.n_objects):
            raise ManifestError(f"{c.here}: an extent names an object the fragment does not list")
        if c.width > self.width:
            self._widen(c.width)
        if c.width < self.width:
            boxes = _widened(boxes, c.width, self.width)
        n, m, k = len(boxes), len(ext), len(crcs)
        self._room(n, m, k)
        r, e, q = self.at
        cols = self.cols
        cols["item"][r : r + n], cols["frag"][r : r + n], cols["boxes"][r : r + n] = item, f, boxes
        cols["ecount"][r : r + n], cols["extents"][e : e + m], cols["crcs"][q : q + k] = ecount, ext, crcs
        cols["extents"][e : e + m, 0] += base
        self.at = [r + n, e + m, q + k]
        self.loaded.append(f)

    def add_wholes(self, frags: Sequence[int], bases: Sequence[int], got: Wholes, width: int) -> None:
        """The rows of whole version-4 fragments ``frags`` (their objects numbered from ``bases``),
        taken at once (:func:`.wholes.take_wholes`, fragments of rank ``width``): what :meth:`add`
        of each in turn would gather."""
        if width > self.width:
            self._widen(width)
        boxes = got.boxes if width == self.width else _widened(got.boxes, width, self.width)
        n, m, k = len(boxes), len(got.extents), got.n_crcs
        self._room(n, m, k, share=len(frags))
        r, e, q = self.at
        cols = self.cols
        cols["item"][r : r + n], cols["frag"][r : r + n] = got.item, np.asarray(frags, np.int64)[got.pos]
        cols["boxes"][r : r + n], cols["ecount"][r : r + n] = boxes, got.ecount
        cols["extents"][e : e + m] = got.extents
        got.crcs_into(cols["crcs"][q : q + k])
        cols["extents"][e : e + m, 0] += np.asarray(bases, np.int64)[got.ext_pos]
        self.at = [r + n, e + m, q + k]
        self.loaded.extend(frags)

    def done(self) -> dict[str, Any]:
        """The gathered columns (views of the filled part)."""
        if not self.cols:
            self._room(0, 0, 0)
        r, e, q = self.at
        out: dict[str, Any] = {k: self.cols[k][:r] for k in _ROW_COLS}
        out["extents"], out["crcs"] = self.cols["extents"][:e], self.cols["crcs"][:q]
        out["width"], out["loaded"] = self.width, np.array(sorted(set(self.loaded)), np.int64)
        return out

    def _rows_of(self, c: Columns) -> tuple[np.ndarray, Any]:
        got = self.known.get(id(c.counts))
        if got is None:
            unknown = [n for n in c.counts if n not in self.ids]
            if unknown:
                raise ManifestError(f"{c.here}: names item {unknown[0]!r} that the root does not hold as an array")
            kept = list(c.counts) if self.names is None else [n for n in c.counts if n in self.names]
            counts = np.array([c.counts[n] for n in kept], np.int64)
            rows_of = (slice(None) if len(kept) == len(c.counts) else  # each item's rows are contiguous
                       _ranges(np.array([c.starts[n] for n in kept], np.int64), counts))
            # c is kept with its dict: an id is only reused once the dict is gone.
            got = self.known[id(c.counts)] = (np.repeat(np.array([self.ids[n] for n in kept], np.int64), counts),
                                              rows_of, c)
        return got[0], got[1]

    def _room(self, n: int, m: int, k: int, share: int = 1) -> None:
        """Columns with room for ``n`` more rows, ``m`` extents and ``k`` checksums: the first
        ``share`` fragments' sizes times those expected, doubled when short (pages never written
        cost no memory, so a generous guess is free)."""
        r, e, q = self.at
        if self.cols and r + n <= len(self.cols["item"]) and e + m <= len(self.cols["extents"]) \
                and q + k <= len(self.cols["crcs"]):
            return
        if self.cols:
            cap = [max(2 * len(self.cols["item"]), r + n), max(2 * len(self.cols["extents"]), e + m),
                   max(2 * len(self.cols["crcs"]), q + k)]
        else:
            w = self.width
            times = max(-(-(self.expect or 1) // share), 1)
            # The guess's address space is capped (a first fragment far larger than the others,
            # times thousands, could be refused by the kernel): past the cap, columns double.
            room = (n * 8 * (3 + 3 * w) + m * 48 + k * 4) * times
            times = max(1, min(times, times * _GUESS_BYTES // max(room, 1)))
            cap = [n * times, m * times, k * times]
        w = self.width
        fresh = {"item": np.empty(cap[0], np.int64), "frag": np.empty(cap[0], np.int64),
                 "boxes": np.empty((cap[0], 3 * w), np.int64), "ecount": np.empty(cap[0], np.int64),
                 "extents": np.empty((cap[1], 6), np.int64), "crcs": np.empty(cap[2], np.uint32)}
        for key, old in self.cols.items():
            used = r if key in _ROW_COLS else e if key == "extents" else q
            fresh[key][:used] = old[:used]
        self.cols = fresh

    def _widen(self, width: int) -> None:
        """Boxes gathered so far padded to rank ``width`` (a fragment of a higher rank came)."""
        if self.cols:
            r = self.at[0]
            boxes = _widened(self.cols["boxes"][:r], self.width, width)
            self.cols["boxes"] = np.empty((len(self.cols["item"]), 3 * width), np.int64)
            self.cols["boxes"][:r] = boxes
        self.width = width
