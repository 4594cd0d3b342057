"""Restore: manifest -> target regions -> overlapping ranges -> verified bytes -> leaves.

The target (the *new* sharding, which may differ from the saved one) picks
what each host reads:

* no target, or ``None`` for a leaf: the whole array as numpy
* a numpy array: filled in place when C-contiguous and writable
* :class:`ckptio.Sharded` with ``(index, None)`` pieces: just those slices
* ``jax.ShapeDtypeStruct`` / ``jax.Array`` with a sharding: a jax.Array
  holding only this host's addressable slices
* a ``torch.Tensor``: filled in place (bfloat16/float8 included)

A target of another dtype than the saved one asks for a cast, as Orbax's
restore does (float32 -> bfloat16 for eval, say): it runs on the host with
:func:`ckptio.cast.cast_checked`, which refuses, naming the item, a cast that
would change a value beyond a float's rounding (an int8 target for a value
of 300, an overflow to inf). A target of another shape is refused: nothing
is ever reshaped. A typed PRNG key target gets its saved key data back as a
typed key.

Targets that ask for a *new* leaf rather than naming a buffer to fill (what
:func:`ckptio.restore_target` makes of a live state):

* a read-only numpy array (a zero-stride ``np.broadcast_to`` view, say): a
  new numpy array of its shape and dtype
* a ``torch.Tensor`` on the ``meta`` device: a new CPU tensor
* a Python scalar (int, float, bool, complex, str, bytes): the saved value as
  that type, where the checkpoint holds a value of a compatible type (see
  :func:`_scalar_value`); anything else raises ValueError naming the item
"""

from __future__ import annotations

import bisect
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio._system import fresh_pages
from ckptio.backends.base import ByteRange

from . import _gc
from .cast import cast_checked, is_inexact, is_numeric
from .engine import Progress, ReadRequest, run_sync
from .distributed import Coordinator, SingleProcess, broadcast_from_root, gather_to_root, join_errors
from .errors import CheckpointNotFoundError, IntegrityError, ManifestError
from .manifest import ArrayItem, Extent, Manifest, ValueItem
from .packtable import PackTable, split_items
from .reshard import Region, coverage_gaps, plan_region
from .staging import Sharded, index_to_box, plain_cpu_tensor, torch_to_numpy
from .store import CheckpointStore
from .tree import flatten_named, is_prng_key, prng_impl_name, unflatten, wrap_prng_key

__all__ = ["restore_checkpoint", "restore_step"]

log = logging.getLogger("ckptio.restore")

Finish = Callable[[], Any]


def _is_target_leaf(x: Any) -> bool:
    if isinstance(x, (np.ndarray, Sharded)) or x is None:
        return True
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _check(name: str, item: ArrayItem, shape: tuple[int, ...], dtype: Any) -> np.dtype:
    """The dtype a target of ``shape`` and ``dtype`` asks for; ValueError if the shape differs.

    A target of another dtype is a request to cast (as Orbax's restore does; checked by
    :func:`ckptio.cast.cast_checked` once the bytes are in); a shape is never changed.
    """
    if tuple(shape) != item.shape:
        raise ValueError(
            f"item {name!r}: target is {np.dtype(dtype)}{list(shape)} but the checkpoint holds "
            f"{item.dtype}{list(item.shape)} (ckptio never reshapes; restore it whole and reshape it yourself)"
        )
    want = np.dtype(dtype)
    if want != item.dtype and not (is_numeric(item.dtype) and is_numeric(want)):
        raise ValueError(f"item {name!r}: the checkpoint holds {item.dtype}, which cannot be cast to {want}")
    return want


def _cast(name: str, host: np.ndarray, want: np.dtype) -> np.ndarray:
    return cast_checked(name, host, want, asked=True)


def _dest(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A restore destination: uninitialised, C-contiguous, page-aligned when large. Private 4 KiB
    pages, not ``np.empty``'s transparent huge pages, whose first touch cost a cold restore
    0.44-2.3 s per GiB here as the kernel compacted memory or not (backends/_pages.py)."""
    return fresh_pages(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)


def _regions(name: str, item: ArrayItem, target: Any) -> tuple[list[Region], Finish]:
    """Destination regions for one array item, and how to build the leaf once they are filled.

    Bytes land in buffers of the saved dtype; a target of another dtype gets a checked cast
    of them (see :func:`_check`).
    """
    if (target is None or isinstance(target, np.generic)
            or (isinstance(target, np.ndarray) and not (target.flags.c_contiguous and target.flags.writeable))):
        want = item.dtype if target is None else _check(name, item, target.shape, target.dtype)
        dest = _dest(item.shape, item.dtype)
        as_scalar = item.scalar or isinstance(target, np.generic)  # a numpy scalar target: one back

        def whole() -> Any:
            out = _cast(name, dest, want)
            return out[()] if as_scalar else out

        return [Region((0,) * len(item.shape), dest)], whole
    if isinstance(target, np.ndarray):
        if _check(name, item, target.shape, target.dtype) == item.dtype:
            return [Region((0,) * target.ndim, target)], lambda: target
        dest = _dest(item.shape, item.dtype)
        return [Region((0,) * target.ndim, dest)], lambda: (np.copyto(target, _cast(name, dest, target.dtype)), target)[1]
    if isinstance(target, Sharded):
        return _sharded_regions(name, item, target)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return _jax_regions(name, item, target, jax)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        t = target.detach()
        view = torch_to_numpy(t) if t.device.type == "cpu" and t.is_contiguous() else None
        if view is not None and _check(name, item, view.shape, view.dtype) == item.dtype:
            return [Region((0,) * view.ndim, view)], lambda: target
        want = _check(name, item, tuple(t.shape), torch_to_numpy(t.new_empty(0, device="cpu")).dtype)
        dest = _dest(item.shape, item.dtype)
        if t.device.type == "meta":  # no storage to fill (restore_target's tensors): a new CPU tensor
            return [Region((0,) * dest.ndim, dest)], lambda: _numpy_to_torch(_cast(name, dest, want), torch)
        return [Region((0,) * dest.ndim, dest)], lambda: target.copy_(_numpy_to_torch(_cast(name, dest, want), torch))
    if isinstance(target, _PY_SCALARS):
        return _scalar_regions(name, item, target)
    raise TypeError(f"item {name!r}: unsupported restore target of type {type(target).__name__}")


#: Python scalar targets: "restore this value, as this type".
_PY_SCALARS = (bool, int, float, complex, str, bytes)


def _scalar_regions(name: str, item: ArrayItem, target: bool | int | float | complex | str | bytes,
                    ) -> tuple[list[Region], Finish]:
    """A Python scalar target against a saved array: only a 0-d one can be a scalar (a fresh
    flax ``TrainState``'s int ``step`` against the jax array a jitted step saved)."""
    held = f"{item.dtype}{list(item.shape)}"
    have = _python_type(item.dtype)
    # Refused before any byte is read: the shape and dtype alone say whether it can be one.
    if item.shape != () or have is None or not _scalar_fits(_scalar_type(target), have):
        raise _scalar_mismatch(name, target, held)
    dest = _dest((), item.dtype)
    return [Region((), dest)], lambda: _scalar_value(name, have(dest[()]), held, target)


def _python_type(dtype: np.dtype) -> type | None:
    """The Python type of a 0-d array of ``dtype`` as a value; None for one with none (datetime, void)."""
    if dtype.kind == "b":
        return bool
    if dtype.kind in "iu":
        return int
    if dtype.kind == "c":
        return complex
    if dtype.kind in "US":  # a saved np.str_ / np.bytes_
        return str if dtype.kind == "U" else bytes
    return float if is_inexact(dtype) else None  # ml_dtypes' bfloat16 / float8 are inexact 'V' kinds


def _scalar_type(target: Any) -> type:
    return next(t for t in _PY_SCALARS if isinstance(target, t))  # bool first: a bool is an int too


def _scalar_fits(want: type, have: type) -> bool:
    """A saved ``have`` may restore into a ``want`` target: the same type, or a number that widens
    (int into float or complex, float into complex); bool never passes for a number."""
    return have is want or (have is not bool and have in _WIDENS.get(want, ()))


_WIDENS: dict[type, tuple[type, ...]] = {float: (int,), complex: (int, float)}


def _scalar_mismatch(name: str, target: Any, held: str) -> ValueError:
    want = _scalar_type(target)
    also = " or ".join(t.__name__ for t in _WIDENS.get(want, ()))
    return ValueError(
        f"item {name!r}: the target is a Python {want.__name__} ({target!r}), but the checkpoint holds {held}; "
        f"a {want.__name__} target restores a saved {want.__name__}{f' (or an {also} it holds exactly)' if also else ''}"
    )


def _scalar_value(name: str, value: Any, held: str, target: Any) -> Any:
    """Saved ``value`` as the Python type of scalar ``target``; ValueError naming item ``name``
    where the types do not match or a widened number would change. A mismatch means the target
    does not describe this checkpoint, so it is refused rather than cast."""
    want = _scalar_type(target)
    ok = _scalar_fits(want, type(value))
    if ok and type(value) is not want:
        try:
            ok = want(value) == value
        except OverflowError:  # an int too large for a float
            ok = False
    if not ok:
        raise _scalar_mismatch(name, target, f"{held} {value!r}")
    return want(value)


def _sharded_regions(name: str, item: ArrayItem, target: Sharded) -> tuple[list[Region], Finish]:
    """A :class:`Sharded` target: its pieces, filled in place where they are buffers of the saved dtype."""
    want = _check(name, item, target.shape, target.dtype)
    regions, pieces = [], []
    for index, data in target.pieces:
        offs, sizes = index_to_box(index, target.shape)
        ok = isinstance(data, np.ndarray) and data.shape == sizes and data.dtype == item.dtype
        dest = data if ok and data.flags.c_contiguous and data.flags.writeable else _dest(sizes, item.dtype)
        regions.append(Region(offs, dest))
        pieces.append((index, dest))
    if want == item.dtype:
        return regions, lambda: Sharded(target.shape, target.dtype, pieces)

    def finish() -> Sharded:
        out = []
        for (index, dest), (_i, data) in zip(pieces, target.pieces):
            cast = _cast(name, dest, want)
            if isinstance(data, np.ndarray) and data.shape == cast.shape and data.dtype == want and data.flags.writeable:
                np.copyto(data, cast)  # the caller's buffer of the asked dtype is filled, as without a cast
                cast = data
            out.append((index, cast))
        return Sharded(target.shape, want, out)

    return regions, finish


def _numpy_to_torch(arr: np.ndarray, torch: Any) -> Any:
    name = arr.dtype.name
    if arr.dtype.type.__module__.startswith("ml_dtypes") and hasattr(torch, name):
        return torch.from_numpy(arr.view(np.int16 if arr.dtype.itemsize == 2 else np.uint8)).view(getattr(torch, name))
    return torch.from_numpy(arr)


def _jax_regions(name: str, item: ArrayItem, target: Any, jax: Any) -> tuple[list[Region], Finish]:
    if is_prng_key(target):
        return _prng_key_regions(name, item, target, jax)
    want = _check(name, item, target.shape, target.dtype)
    # With jax_enable_x64 off a jax array cannot be 64-bit: narrowing is forced, so it must be exact.
    final = np.dtype(jax.dtypes.canonicalize_dtype(want))

    def host(buf: np.ndarray) -> np.ndarray:
        return cast_checked(name, _cast(name, buf, want), final, asked=False)

    sharding = getattr(target, "sharding", None)
    if sharding is None:
        dest = _dest(item.shape, item.dtype)
        return [Region((0,) * dest.ndim, dest)], lambda: jax.numpy.asarray(host(dest))
    by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
    devices = []
    for device, index in sharding.addressable_devices_indices_map(tuple(item.shape)).items():
        box = index_to_box(index, item.shape)
        if box not in by_box:
            # Page-aligned, so that a CPU device can adopt the buffer without a copy (below).
            by_box[box] = _dest(box[1], item.dtype)
        devices.append((device, box))
    regions = [Region(box[0], dest) for box, dest in by_box.items()]

    def finish() -> Any:
        hosts = {box: host(buf) for box, buf in by_box.items()}  # every cast checked before any transfer
        arrays, adopted = [], set()
        for device, box in devices:
            # One device adopts each buffer; replicas get copies, so donating one never touches another.
            arrays.append(_device_put(jax, hosts[box], device, alias=box not in adopted))
            adopted.add(box)
        return jax.make_array_from_single_device_arrays(tuple(item.shape), sharding, arrays)

    return regions, finish


def _prng_key_regions(name: str, item: ArrayItem, target: Any, jax: Any) -> tuple[list[Region], Finish]:
    """A typed PRNG key target: read its key data (saved as uint32 under the key's path), wrap it."""
    impl = prng_impl_name(target)
    shape = tuple(target.shape)
    if item.shape[: len(shape)] != shape or item.dtype != np.uint32:
        raise ValueError(
            f"item {name!r}: the target is a {impl} PRNG key array of shape {list(shape)}, but the checkpoint "
            f"holds {item.dtype}{list(item.shape)}, not its key data"
        )
    if isinstance(target, jax.Array):
        data_target: Any = jax.random.key_data(target)  # carries the key array's sharding
    else:  # a NamedSharding's spec leaves the trailing key dimensions replicated
        data_target = jax.ShapeDtypeStruct(item.shape, item.dtype, sharding=getattr(target, "sharding", None))
    regions, finish = _jax_regions(name, item, data_target, jax)
    return regions, lambda: wrap_prng_key(finish(), impl)


def _device_put(jax: Any, host: np.ndarray, device: Any, alias: bool) -> Any:
    """Place a restored host buffer on ``device``. The buffer is ours alone, so a CPU device may
    alias it (no second copy of the state); accelerators copy it as usual."""
    if alias and device.platform == "cpu":
        try:
            return jax.device_put(host, device, may_alias=True)
        except TypeError:  # a jax without may_alias
            pass
    return jax.device_put(host, device)


def restore_checkpoint(
    store: CheckpointStore,
    manifest: Manifest,
    step_dir: str,
    target: Any = None,
    *,
    progress: Progress | None = None,
) -> Any:
    """Read ``manifest``'s items (as ``target`` asks) and rebuild the tree."""
    where = store.where(step_dir)
    tables: list[PackTable] = []
    if target is None:
        # A whole restore reads a format-5 manifest's pack tables in bulk, as columns.
        plain, tables = split_items(manifest.items)
        wanted = dict.fromkeys(plain)
        structure = manifest.tree
    else:
        names, values, structure = flatten_named(target, is_leaf=_is_target_leaf)
        wanted = dict(zip(names, values))
        missing = [n for n in wanted if n not in manifest.items]
        if missing:
            raise CheckpointNotFoundError(
                f"{where}: the target asks for {missing[:5]} which the checkpoint does not hold "
                f"(it holds {sorted(manifest.items)[:10]}{'...' if len(manifest.items) > 10 else ''})"
            )
    if not manifest.complete:  # format 2: read only the fragments holding shards this restore meets
        wanted_boxes = {n: _target_boxes(manifest.items[n], t) for n, t in wanted.items()
                        if isinstance(manifest.items[n], ArrayItem)}
        manifest = run_sync(store.load_fragments(step_dir, manifest, wanted_boxes))
    # Objects exist and are as long as the manifest says before anything is allocated from it.
    if not store.host_local:
        run_sync(store.check_objects(manifest, where))
    requests: list[ReadRequest] = []
    finishers: dict[str, Finish] = {}
    small: list[tuple[str, ArrayItem, Extent]] = []
    placed: dict[str, Any] = {}  # small arrays read in bulk for a jax target: its sharding
    into: dict[str, tuple[np.ndarray, Any]] = {}  # ... for a numpy or torch target: its bytes, itself
    bulk_max = min(_BULK_ITEM_BYTES, manifest.block_size)
    jax = sys.modules.get("jax")
    canonical: dict[np.dtype, bool] = {}  # per restore: jax's x64 setting may change between them
    for name, tgt in wanted.items():
        item = manifest.items[name]
        if isinstance(item, ValueItem):
            value = item.value
            if isinstance(tgt, _PY_SCALARS):
                value = _scalar_value(name, value, "the value", tgt)
            finishers[name] = lambda v=value: v
            continue
        if manifest.complete and len(item.shards) == 1:
            shard = item.shards[0]
            if shard.tile is None and len(shard.extents) == 1 and 0 < shard.extents[0].length <= bulk_max:
                # A whole small array: read in bulk, then placed on jax devices or copied into the target.
                view = None if tgt is None else _inplace_view(tgt, item)
                if tgt is None or view is not None or _replicated_jax(jax, tgt, item, canonical):
                    small.append((name, item, shard.extents[0]))
                    if view is not None:
                        into[name] = (view, tgt)
                    elif tgt is not None:
                        placed[name] = tgt.sharding
                    continue
        regions, finishers[name] = _regions(name, item, tgt)
        for r in regions:
            whole = manifest.complete and r.dest.shape == item.shape  # a validated tiling covers it all
            gaps = 0 if whole else coverage_gaps(item, r.offsets, tuple(r.dest.shape))
            if gaps:
                raise CheckpointNotFoundError(f"{where}: item {name!r}: {gaps} elements of the target slice are not saved")
            requests += plan_region(name, item, r, manifest.objects, manifest.block_size)
    max_read = store.engine.config.max_read_size
    bulk_requests, bulk_finish = _bulk(small, manifest.objects, manifest.block_size, max_read)
    table_requests, table_finish = _table_reads(tables, manifest.objects, manifest.block_size, max_read)
    run_sync(store.engine.read(requests + bulk_requests + table_requests, progress))
    results = {name: finish() for name, finish in finishers.items()}
    results.update(bulk_finish())
    results.update(table_finish())
    for name, (view, tgt) in into.items():
        np.copyto(view, results[name])
        results[name] = tgt
    if placed:  # one batched transfer for all of them (per-array device_put costs ~60 us each)
        names = list(placed)
        results.update(zip(names, jax.device_put([results[n] for n in names], [placed[n] for n in names])))
    return unflatten(structure, results.__getitem__)


def _inplace_view(target: Any, item: ArrayItem) -> np.ndarray | None:
    """The bytes of a numpy or CPU torch ``target`` that ``item`` fills as it was saved (same dtype
    and shape, contiguous, writeable), or None."""
    if isinstance(target, np.ndarray):
        ok = target.flags.c_contiguous and target.flags.writeable
        return target if ok and target.dtype == item.dtype and target.shape == item.shape else None
    if not plain_cpu_tensor(target):
        return None
    view = torch_to_numpy(target.detach())
    return view if view.dtype == item.dtype and view.shape == item.shape else None


def _replicated_jax(jax: Any, target: Any, item: ArrayItem, canonical_dtypes: dict[np.dtype, bool]) -> bool:
    """``target`` asks for ``item`` whole, as it was saved, on every device it names (replicated)."""
    if jax is None or not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return False
    dtype, sharding = target.dtype, getattr(target, "sharding", None)
    if not isinstance(dtype, np.dtype) or dtype != item.dtype or tuple(target.shape) != item.shape:
        return False  # a typed PRNG key, a cast or another shape: the general path
    if sharding is None or not isinstance(sharding, jax.sharding.Sharding):
        return False
    canonical = canonical_dtypes.get(dtype)
    if canonical is None:  # a 64-bit array without x64 is narrowed (checked) by the general path
        canonical = canonical_dtypes[dtype] = np.dtype(jax.dtypes.canonicalize_dtype(dtype)) == dtype
    return canonical and sharding.is_fully_replicated and sharding.is_fully_addressable


#: Whole arrays up to this size (one extent, one checksum block) are read in bulk.
_BULK_ITEM_BYTES = 1 << 20
_BULK_GAP = 64 << 10  # skipped bytes (padding, another host's data) read rather than split


def _bulk(
    small: list[tuple[str, ArrayItem, Extent]], objects: list[str], block_size: int, max_read: int,
) -> tuple[list[ReadRequest], Callable[[], dict[str, Any]]]:
    """Whole small arrays (a state's norms, biases, counters: 10k-100k of them) read as few
    large requests, with no per-leaf plan: the arrays packed together in an object become one
    read into one buffer, each verified against its own checksum, and each restored array is a
    view of that buffer (a copy where its offset does not suit its dtype's alignment).

    Returns the requests and the function that builds the leaves once they are read.
    """
    small.sort(key=lambda t: (t[2].object, t[2].offset))
    requests: list[ReadRequest] = []
    spans: list[tuple[np.ndarray, int, list[tuple[str, ArrayItem, Extent]]]] = []
    i = 0
    while i < len(small):
        first = small[i][2]
        j, end = i + 1, first.offset + first.length
        while j < len(small):
            e = small[j][2]
            # Next to each other in one object (alignment padding aside) and within one read.
            if e.object != first.object or e.offset - end > _BULK_GAP or e.offset + e.length - first.offset > max_read:
                break
            end = e.offset + e.length
            j += 1
        members = small[i:j]
        buf = fresh_pages(end - first.offset)
        checks = [(e.offset - first.offset, e.length, e.crcs, name) for name, _item, e in members]
        requests.append(ReadRequest(objects[first.object], ByteRange(first.offset, end), [memoryview(buf)], checks,
                                    [], block_size))
        spans.append((buf, first.offset, members))
        i = j

    def finish() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for buf, base, members in spans:
            for name, item, e in members:
                at = e.offset - base
                if at % item.dtype.alignment == 0:
                    arr = np.ndarray(item.shape, item.dtype, buf, at)
                else:  # a view would be unaligned
                    arr = buf[at : at + e.length].copy().view(item.dtype).reshape(item.shape)
                out[name] = arr[()] if item.scalar else arr
        return out

    return requests, finish


def _table_reads(
    tables: list[PackTable], objects: list[str], block_size: int, max_read: int,
) -> tuple[list[ReadRequest], Callable[[], dict[str, Any]]]:
    """Every member of format-5 pack tables: one read per pack (or per ``max_read`` bytes of it)
    into one buffer, each member verified against its own checksum, each restored array a view
    of that buffer. A pack holds one dtype back to back, so every member is aligned for it.

    Returns the requests and the function that builds the leaves once they are read.
    """
    requests: list[ReadRequest] = []
    spans: list[tuple[PackTable, int, int, np.ndarray, int]] = []
    for t in tables:
        ends, i = t.ends, 0
        while i < len(ends):
            base = t.span(i)[0]
            j = max(bisect.bisect_right(ends, base + max_read, i), i + 1)  # members [i, j) in one read
            buf = fresh_pages(ends[j - 1] - base)
            checks = [(start - base, end - start, [crc], name) for start, end, crc, name
                      in zip([base, *ends[i : j - 1]], ends[i:j], t.crcs[i:j], t.names[i:j])]
            requests.append(ReadRequest(objects[t.object], ByteRange(t.offset + base, t.offset + ends[j - 1]),
                                        [memoryview(buf)], checks, [], block_size))
            spans.append((t, i, j, buf, base))
            i = j

    def finish() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for t, i, j, buf, base in spans:
            out.update(zip(t.names[i:j], _members(t, i, j, buf, base)))
        return out

    return requests, finish


def _members(t: PackTable, i: int, j: int, buf: np.ndarray, base: int) -> list[Any]:
    """Members ``[i, j)`` of ``t`` as arrays over ``buf`` (which holds its bytes from ``base`` on)."""
    dtype, shapes = t.dtype, t.shapes[i:j]
    # fresh_pages: page-aligned, or numpy's allocator (16 bytes, every dtype's alignment at most).
    assert buf.ctypes.data % dtype.alignment == 0
    if shapes[0] and shapes.count(shapes[0]) == len(shapes) and not t.scalars:
        # One shape throughout (a layer's worth of equal vectors): the rows of one 2-D view.
        return list(np.ndarray((j - i, *shapes[0]), dtype, buf, 0))
    out: list[Any] = []
    for m, shape in enumerate(shapes, i):
        arr = np.ndarray(shape, dtype, buf, t.span(m)[0] - base)
        out.append(arr[()] if m in t.scalars else arr)
    return out


def _target_boxes(item: ArrayItem, target: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of ``item`` a restore into ``target`` reads (before anything is allocated)."""
    whole = [((0,) * len(item.shape), tuple(item.shape))]
    if isinstance(target, Sharded):
        return [index_to_box(index, target.shape) for index, _data in target.pieces]
    sharding = getattr(target, "sharding", None)
    jax = sys.modules.get("jax")
    if sharding is not None and jax is not None and isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        try:
            indices = sharding.addressable_devices_indices_map(tuple(item.shape)).values()
        except (ValueError, TypeError):
            return whole  # a shape the sharding refuses: _regions reports it
        return sorted({index_to_box(index, item.shape) for index in indices})
    return whole


def restore_step(store: CheckpointStore, step: int | None, target: Any = None, *,
                 progress: Progress | None = None, coordinator: Coordinator | None = None) -> Any:
    """Restore ``step`` (None: the newest restorable committed step) of ``store``.

    With ``step=None``, a step that turns out not to restore -- an object or a
    fragment missing, short or failing its checksums, a damaged or unreadable
    manifest, or a deletion racing the restore -- is logged by name and the
    next newest is restored instead. With a ``coordinator`` of several hosts
    (every host must call this) that is one collective decision: host 0 picks
    the step, every host tries it, and if any host fails every host moves on,
    so all restore the same step. With ``step=N`` the failure is raised,
    naming what is missing.
    """
    with _gc.paused():  # the caller waits anyway: no collections in the middle of the burst
        return _restore_step(store, step, target, progress, coordinator or SingleProcess())


#: What makes a step not restore (as opposed to a bad target or a storage outage).
_LOST = (FileNotFoundError, IntegrityError, ManifestError, PermissionError)


def _restore_step(
    store: CheckpointStore, step: int | None, target: Any, progress: Progress | None, coord: Coordinator
) -> Any:
    tried: list[int] = []
    first: BaseException | None = None  # what the newest step failed with: raised if nothing older restores
    many = step is None and coord.size > 1
    while True:
        try:
            step_dir, manifest = _pick(store, step, tried, coord) if many else run_sync(
                store.resolve_manifest(step, skip=tried, shards=False))
        except CheckpointNotFoundError as e:
            if first is None:
                raise
            raise first from e
        failure: BaseException | None = None
        fatal = False  # a failure that another step would not mend (a bad target, an outage)
        out: Any = None
        try:
            out = restore_checkpoint(store, manifest, step_dir, target, progress=progress)
        except CheckpointNotFoundError as e:  # the target names an item the checkpoint lacks: not damage
            if not many:
                raise
            failure, fatal = e, True
        except _LOST as e:
            failure = _lost(store, step, step_dir, manifest, e)
        except BaseException as e:
            if not many:
                raise
            failure, fatal = e, True
        if many:  # every host learns whether every host restored this step, even after a failure
            mine = None if failure is None else (fatal, f"host {coord.rank}: {type(failure).__name__}: {failure}")
            reports = gather_to_root(coord, mine)
            verdict = broadcast_from_root(coord, None if reports is None else (
                any(r[0] for r in reports if r), join_errors([r[1] for r in reports if r])))
            if fatal:
                raise failure  # type: ignore[misc]
            if verdict[1] and failure is None:
                failure = CheckpointNotFoundError(f"{store.where(step_dir)}: not restored on every host: {verdict[1]}")
            if verdict[0]:
                raise failure  # type: ignore[misc]
        if failure is None:
            return out
        if step is not None or not step_dir:
            raise failure
        log.warning("%s: step %s does not restore (%s); restoring the next newest step",
                    store.url, step_dir, failure)
        first = first or failure
        tried.append(int(step_dir))


def _pick(store: CheckpointStore, step: int | None, tried: list[int], coord: Coordinator) -> tuple[str, Manifest]:
    """Host 0's choice of the step to try, read on every host (one decision for the whole job)."""
    choice: dict[str, Any] = {}
    if coord.rank == 0:
        try:
            choice = {"step_dir": run_sync(store.resolve_manifest(step, skip=tried, shards=False))[0]}
        except BaseException as e:  # every host must raise it, not wait for a choice
            choice = {"error": f"{type(e).__name__}: {e}"}
    choice = broadcast_from_root(coord, choice)
    if "error" in choice:
        raise CheckpointNotFoundError(f"{store.url}: {choice['error']}")
    return choice["step_dir"], run_sync(store.read_manifest(choice["step_dir"], shards=False))


def _lost(store: CheckpointStore, step: int | None, step_dir: str, manifest: Manifest, e: BaseException
          ) -> BaseException:
    """The error to report for a restore of ``step_dir`` that failed with ``e``: a deletion that
    raced the restore is said to be one."""
    if not step_dir or run_sync(_still_there(store, step_dir, manifest.checkpoint_id)):
        return e  # the checkpoint is there: a missing or damaged object is damage, not a race
    gone = CheckpointNotFoundError(f"{store.where(step_dir)}: step {step_dir} was deleted while being restored")
    gone.__cause__ = e
    return gone


async def _still_there(store: CheckpointStore, step_dir: str, checkpoint_id: str) -> bool:
    try:
        return (await store.read_manifest(step_dir, shards=False)).checkpoint_id == checkpoint_id
    except (FileNotFoundError, ValueError, IntegrityError):
        return False
