"""Restore targets: what each kind of target leaf reads, and how its leaf is built from the bytes.

The target (the *new* sharding, which may differ from the saved one) picks
what each host reads:

* no target, or ``None`` for a leaf: the whole array as numpy
* a numpy array: filled in place when C-contiguous and writable
* :class:`ckptio.Sharded` with ``(index, None)`` pieces: just those slices
* ``jax.ShapeDtypeStruct`` / ``jax.Array`` with a sharding: a jax.Array
  holding only this host's addressable slices
* a ``torch.Tensor``: filled in place (bfloat16/float8 included)

A target of another dtype than the saved one asks for a cast (see
:mod:`ckptio.restoring.buffers`); a target of another shape is refused. A typed
PRNG key target gets its saved key data back as a typed key.

Targets that ask for a *new* leaf rather than naming a buffer to fill (what
:func:`ckptio.restore_target` makes of a live state):

* a read-only numpy array (a zero-stride ``np.broadcast_to`` view, say): a
  new numpy array of its shape and dtype
* a ``torch.Tensor`` on the ``meta`` device: a new CPU tensor
* a Python scalar (int, float, bool, complex, str, bytes): the saved value as
  that type (:mod:`ckptio.restoring.scalars`)

Each kind answers, for one array item, the destination :class:`Region`\\ s
and the :data:`Finish` that builds the leaf once they are filled; the plan
(:mod:`ckptio.restoring.planner`) turns regions into reads.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ckptio.manifest import ArrayItem
from ckptio.restoring.buffers import Finish, cast, check_target, dest_buffer
from ckptio.restoring.reshard import Region
from ckptio.restoring.scalars import PY_SCALARS, scalar_regions
from ckptio.state.cast import cast_checked
from ckptio.state.leaves import Sharded, index_to_box, plain_cpu_tensor, torch_to_numpy
from ckptio.state.tree import is_prng_key, prng_impl_name, wrap_prng_key

__all__ = ["device_put", "inplace_view", "is_target_leaf", "replicated_jax", "target_boxes", "target_regions"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def is_target_leaf(x: Any) -> bool:
    if isinstance(x, (np.ndarray, Sharded)) or x is None:
        return True
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def target_regions(name: str, item: ArrayItem, target: Any) -> tuple[list[Region], Finish]:
    """Destination regions for one array item, and how to build the leaf once they are filled.

    Bytes land in buffers of the saved dtype; a target of another dtype gets a checked cast
    of them (see :func:`ckptio.restoring.buffers.check_target`).
    """
    if (target is None or isinstance(target, np.generic)
            or (isinstance(target, np.ndarray) and not (target.flags.c_contiguous and target.flags.writeable))):
        want = item.dtype if target is None else check_target(name, item, target.shape, target.dtype)
        dest = dest_buffer(item.shape, item.dtype)
        as_scalar = item.scalar or isinstance(target, np.generic)  # a numpy scalar target: one back

        def whole() -> Any:
            out = cast(name, dest, want)
            return out[()] if as_scalar else out

        return [Region((0,) * len(item.shape), dest)], whole
    if isinstance(target, np.ndarray):
        if check_target(name, item, target.shape, target.dtype) == item.dtype:
            return [Region((0,) * target.ndim, target)], lambda: target
        dest = dest_buffer(item.shape, item.dtype)
        return [Region((0,) * target.ndim, dest)], lambda: (np.copyto(target, cast(name, dest, target.dtype)), target)[1]
    if isinstance(target, Sharded):
        return _sharded_regions(name, item, target)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return _jax_regions(name, item, target, jax)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        t = target.detach()
        view = torch_to_numpy(t) if t.device.type == "cpu" and t.is_contiguous() else None
        if view is not None and check_target(name, item, view.shape, view.dtype) == item.dtype:
            return [Region((0,) * view.ndim, view)], lambda: target
        want = check_target(name, item, tuple(t.shape), torch_to_numpy(t.new_empty(0, device="cpu")).dtype)
        dest = dest_buffer(item.shape, item.dtype)
        if t.device.type == "meta":  # no storage to fill (restore_target's tensors): a new CPU tensor
            return [Region((0,) * dest.ndim, dest)], lambda: _numpy_to_torch(cast(name, dest, want), torch)
        return [Region((0,) * dest.ndim, dest)], lambda: target.copy_(_numpy_to_torch(cast(name, dest, want), torch))
    if isinstance(target, PY_SCALARS):
        return scalar_regions(name, item, target)
    raise TypeError(f"item {name!r}: unsupported restore target of type {type(target).__name__}")


def _sharded_regions(name: str, item: ArrayItem, target: Sharded) -> tuple[list[Region], Finish]:
    """A :class:`Sharded` target: its pieces, filled in place where they are buffers of the saved dtype."""
    want = check_target(name, item, target.shape, target.dtype)
    regions, pieces = [], []
    for index, data in target.pieces:
        offs, sizes = index_to_box(index, target.shape, f"item {name!r}")
        ok = isinstance(data, np.ndarray) and data.shape == sizes and data.dtype == item.dtype
        dest = data if ok and data.flags.c_contiguous and data.flags.writeable else dest_buffer(sizes, item.dtype)
        regions.append(Region(offs, dest))
        pieces.append((index, dest))
    if want == item.dtype:
        return regions, lambda: Sharded(target.shape, target.dtype, pieces)

    def finish() -> Sharded:
        out = []
        for (index, dest), (_i, data) in zip(pieces, target.pieces):
            got = cast(name, dest, want)
            if isinstance(data, np.ndarray) and data.shape == got.shape and data.dtype == want and data.flags.writeable:
                np.copyto(data, got)  # the caller's buffer of the asked dtype is filled, as without a cast
                got = data
            out.append((index, got))
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
    want = check_target(name, item, target.shape, target.dtype)
    # With jax_enable_x64 off a jax array cannot be 64-bit: narrowing is forced, so it must be exact.
    final = np.dtype(jax.dtypes.canonicalize_dtype(want))

    def host(buf: np.ndarray) -> np.ndarray:
        return cast_checked(name, cast(name, buf, want), final, asked=False)

    sharding = getattr(target, "sharding", None)
    if sharding is None:
        dest = dest_buffer(item.shape, item.dtype)
        return [Region((0,) * dest.ndim, dest)], lambda: jax.numpy.asarray(host(dest))
    by_box: dict[Box, np.ndarray] = {}
    devices = []
    for device, index in sharding.addressable_devices_indices_map(tuple(item.shape)).items():
        box = index_to_box(index, item.shape)
        if box not in by_box:
            # Page-aligned, so that a CPU device can adopt the buffer without a copy (below).
            by_box[box] = dest_buffer(box[1], item.dtype)
        devices.append((device, box))
    regions = [Region(box[0], dest) for box, dest in by_box.items()]

    def finish() -> Any:
        hosts = {box: host(buf) for box, buf in by_box.items()}  # every cast checked before any transfer
        arrays, adopted = [], set()
        for device, box in devices:
            # One device adopts each buffer; replicas get copies, so donating one never touches another.
            arrays.append(device_put(jax, hosts[box], device, alias=box not in adopted))
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


def device_put(jax: Any, host: np.ndarray, device: Any, alias: bool) -> Any:
    """Place a restored host buffer on ``device``. The buffer is ours alone, so a CPU device may
    alias it (no second copy of the state); accelerators copy it as usual."""
    if alias and device.platform == "cpu":
        try:
            return jax.device_put(host, device, may_alias=True)
        except TypeError:  # a jax without may_alias
            pass
    return jax.device_put(host, device)


def inplace_view(target: Any, item: ArrayItem) -> np.ndarray | None:
    """The bytes of a numpy or CPU torch ``target`` that ``item`` fills as it was saved (same dtype
    and shape, contiguous, writeable), or None."""
    if isinstance(target, np.ndarray):
        ok = target.flags.c_contiguous and target.flags.writeable
        return target if ok and target.dtype == item.dtype and target.shape == item.shape else None
    if not plain_cpu_tensor(target):
        return None
    view = torch_to_numpy(target.detach())
    return view if view.dtype == item.dtype and view.shape == item.shape else None


def replicated_jax(jax: Any, target: Any, item: ArrayItem, canonical_dtypes: dict[np.dtype, bool]) -> bool:
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


def target_boxes(item: ArrayItem, target: Any) -> list[Box]:
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
            return whole  # a shape the sharding refuses: target_regions reports it
        return sorted({index_to_box(index, item.shape) for index in indices})
    return whole

