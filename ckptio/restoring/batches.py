"""Restoring a format-2 checkpoint in batches of fragments that fit a metadata budget.

A host restoring a column block of every array of a job of thousands of hosts meets every row
of every fragment: planned at once, it holds every row's extents and checksums (28 M checksums
at 4096 x 256) until the last read is verified. Here the fragments a restore meets are cut into
batches whose metadata fits a budget (:func:`fragment_batches`, estimated from the root alone);
the target's regions and finishers are made once, from the root (:class:`Batched`); then each
batch is loaded (only the wanted items' rows), planned against those regions, read and verified
by the caller, and dropped -- rows, checksums and requests -- before the next batch is loaded.

Each fragment is read once. The root assigns every saved box to one fragment, so batches hold
disjoint shards and each stored byte a region needs is read once, as in the one-shot plan
(:mod:`ckptio.restoring.planner`); every byte is still verified against its checksums before it is
copied out. What the one-shot plan checks before reading -- that the saved shards cover each
region -- is checked against the root's locators before the first read, and again against the
shards the fragments actually held once every batch is planned (a fragment that lacks a row its
root promises is refused, naming the item, before the tree is built).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

from ckptio.engine import ReadRequest
from ckptio.errors import CheckpointNotFoundError, ManifestError
from ckptio.manifest import ArrayItem, Manifest, table_of
from ckptio.manifest.lazy import fragments_for
from ckptio.restoring.planner import ReadPlan, Selection, _Builder
from ckptio.restoring.reshard import Region, geometry_key, plan_regions
from ckptio.restoring.targets import target_regions

__all__ = ["METADATA_BUDGET", "Batched", "fragment_batches", "fragment_cut", "locator_gaps"]

#: Bytes of metadata a restoring host holds at once, by default: the decoded rows, extents and
#: checksums of a batch of fragments and the read requests planned from them.
METADATA_BUDGET = 64 << 20
#: Bytes held per fragment byte of wanted rows while a batch is loaded and planned (decoded
#: columns, the loader's copies of them, per-item tables, requests): peak RSS grew by ~5.2 bytes
#: per fragment byte of a batch at 4096 x 256, rows -> columns (bench.scale, version-3 fragments).
HELD_PER_BYTE = 5
_I64 = np.int64


def fragment_batches(root: Manifest, numbers: list[int], names: Collection[str], budget: int) -> list[list[int]]:
    """``numbers`` (fragments of ``root``, ascending) cut, in order, into batches whose estimated
    held metadata (:data:`HELD_PER_BYTE` x the bytes of their rows of items ``names``) is at most
    ``budget``; a fragment larger than the budget is a batch of its own.

    A fragment's share of its bytes that a restore keeps is estimated from the root: the rows
    its locators give the wanted items, over the rows they give every array item."""
    frags = root.fragments or []
    n = len(frags)
    wanted, every = np.zeros(n, _I64), np.zeros(n, _I64)
    per_locator: dict[int, tuple[np.ndarray, int, int]] = {}  # id -> (rows per fragment, items, wanted items)
    for name, item in root.items.items():
        if not isinstance(item, ArrayItem) or item.locator is None:
            continue
        counts, k, w = per_locator.get(id(item.locator)) or (np.bincount(item.locator[:, 0], minlength=n), 0, 0)
        per_locator[id(item.locator)] = (counts, k + 1, w + (name in names))
    for counts, k, w in per_locator.values():
        every += counts * k
        wanted += counts * w
    sizes = np.array([frags[f].size for f in numbers], np.float64)
    nums = np.asarray(numbers, _I64)
    cost = sizes * HELD_PER_BYTE * wanted[nums] / np.maximum(every[nums], 1)
    out: list[list[int]] = [[]]  # no fragment to read: one empty batch
    held = 0.0
    for f, c in zip(numbers, cost.tolist()):
        if held + c <= budget or not out[-1]:
            out[-1].append(f)
            held += c
        else:
            out.append([f])
            held = c
    return out


def locator_gaps(item: ArrayItem, off: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Elements of the box ``(off, shape)`` that ``item``'s locator (a format-2 root's boxes of
    its shards) does not cover; the locator's boxes never overlap in a checkpoint that restores."""
    table, ndim = item.locator, len(item.shape)
    assert table is not None
    if not ndim:
        return 0 if len(table) else 1
    # Dimension by dimension over whole columns: numpy's reductions along a short row axis cost
    # several times the element-wise work (4096 rows a region at 4096 hosts).
    vol = np.ones(len(table), _I64)
    for d in range(ndim):
        start, length = table[:, 1 + d], table[:, 1 + ndim + d]
        lo = np.maximum(start, off[d])
        hi = np.minimum(start + length, off[d] + shape[d])
        vol *= np.maximum(hi - lo, 0)
    return math.prod(shape) - int(vol.sum())


class _RootBuilder(_Builder):
    """:class:`~ckptio.restoring.planner._Builder` over a format-2 root: every array item becomes
    regions (nothing joins the bulk reads, as with any partly loaded root), checked for coverage
    against the root's locators."""

    def __init__(self, manifest: Manifest, where: str, host: tuple[int, int] | None = None) -> None:
        super().__init__(manifest, where, host)
        #: Gaps per (locator, box): arrays of one layout share their locator and ask one box.
        self.gaps: dict[tuple[Any, ...], int] = {}

    def _regions(self, name: str, item: ArrayItem, tgt: Any) -> None:
        regions, self.finishers[name] = target_regions(name, item, tgt)
        gaps = self.gaps
        for r in regions:
            key = (id(item.locator), r.offsets, tuple(r.dest.shape))
            missing = gaps.get(key)
            if missing is None:
                missing = gaps[key] = locator_gaps(item, r.offsets, tuple(r.dest.shape))
            if missing:
                raise CheckpointNotFoundError(
                    f"{self.where}: item {name!r}: {missing} elements of the target slice are not saved")
            self.regions.append((name, item, r))


class Batched:
    """A restore of a format-2 ``root`` planned batch by batch.

    The target's regions (its destination buffers) and leaf builders are made once, from the
    root; :meth:`plan_batch` plans one batch's loaded manifest against them; :meth:`finish`
    checks that the batches covered every region and builds the tree. A consumer reads and
    verifies each batch's requests and drops them before the next batch is loaded
    (:meth:`batches` does the loading)."""

    def __init__(self, root: Manifest, sel: Selection, where: str, host: tuple[int, int] | None = None) -> None:
        if sel.tables:
            raise ValueError("a batched restore plans no pack tables (format 5 manifests are complete)")
        builder = _RootBuilder(root, where, host)
        for name, tgt in sel.wanted.items():
            builder.add(name, tgt)
        self.root, self.where = root, where
        self.regions: list[tuple[str, Region]] = [(n, r) for n, _item, r in builder.regions]
        self.names = sorted({n for n, _r in self.regions})
        self.covered = np.zeros(len(self.regions), _I64)
        self.read_plan = ReadPlan([], sel.structure, builder.finishers, [], builder.into, builder.placed)

    def plan_batch(self, m: Manifest) -> list[ReadRequest]:
        """The reads of the regions from the shards ``m`` (the root with one batch's fragments
        loaded) holds; counts what they cover."""
        wants = []
        volumes: dict[tuple[Any, ...], int] = {}  # arrays of one layout asking for one box: met once
        for k, (name, region) in enumerate(self.regions):
            item = m.items[name]
            assert isinstance(item, ArrayItem)
            t = table_of(item)
            if not t.n:
                continue
            wants.append((name, item, region))
            key = geometry_key(t, region.offsets, region.dest.shape, 0)
            got = volumes.get(key)
            if got is None:
                _rows, lo, hi = t.meeting(region.offsets, region.dest.shape)
                got = volumes[key] = int(np.prod(hi - lo, axis=1, dtype=_I64).sum()) if len(lo) else 0
            self.covered[k] += got
        return plan_regions(wants, m.objects, m.block_size)

    def batches(self, store: Any, step_dir: str, cut: list[list[int]], *, check: bool = True
                ) -> Iterator[list[ReadRequest]]:
        """Each batch's requests, its fragments (a list of ``cut``, see :func:`fragment_cut`) loaded
        from ``store``, and dropped before the next batch is loaded. The consumer must drop each
        list once read (``del``) before asking for the next. ``check``: each batch's objects are
        checked to be there and long enough before its requests are made (unless the store is
        host-local)."""
        from ckptio.engine import run_sync

        listed: dict[str, dict[str, int]] = {}  # each directory listed once, not once a batch
        for batch in cut:
            m = run_sync(store.load_fragment_numbers(step_dir, self.root, batch, self.names))
            if check and not store.host_local:
                run_sync(store.check_objects(m, self.where, listed))
            reqs = self.plan_batch(m)
            del m
            yield reqs
            del reqs

    def finish(self) -> Any:
        """The restored tree, once every batch was read; ManifestError naming the item if the
        fragments did not hold every element of a region (a row the root promised missing: damage,
        which a restore of the newest step falls back from)."""
        for (name, region), got in zip(self.regions, self.covered.tolist()):
            if got != region.dest.size:
                raise ManifestError(
                    f"{self.where}: item {name!r}: {region.dest.size - got} elements of the target slice "
                    f"are not in the fragments that the root says hold them")
        return self.read_plan.finish()


def fragment_cut(root: Manifest, sel: Selection, budget: int = METADATA_BUDGET) -> list[list[int]] | None:
    """The fragments a restore of ``sel`` from ``root`` loads, in batches that fit ``budget``
    (:func:`fragment_batches`; one batch: plan at once); None where ``root`` is not a format-2
    root still to load (or ``sel`` reads pack tables, which only complete manifests have)."""
    if root.complete or root.fragments is None or sel.tables:
        return None
    boxes = sel.boxes(root)
    return fragment_batches(root, fragments_for(root, boxes), boxes.keys(), budget)
