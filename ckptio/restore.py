"""Restore: manifest -> target regions -> overlapping ranges -> verified bytes -> leaves.

The target (the *new* sharding, which may differ from the saved one) picks
what each host reads:

* no target, or ``None`` for a leaf: the whole array as numpy
* a numpy array: filled in place when C-contiguous and writable
* :class:`ckptio.Sharded` with ``(index, None)`` pieces: just those slices
* ``jax.ShapeDtypeStruct`` / ``jax.Array`` with a sharding: a jax.Array
  holding only this host's addressable slices
* a ``torch.Tensor``: filled in place (bfloat16/float8 included)
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .engine import Progress, ReadRequest, run_sync
from .errors import CheckpointNotFoundError, IntegrityError
from .manifest import ArrayItem, Manifest, ValueItem
from .reshard import Region, coverage_gaps, plan_region
from .staging import Sharded, aligned_empty, index_to_box, torch_to_numpy
from .store import CheckpointStore
from .tree import flatten, path_str, unflatten

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


def _check(name: str, item: ArrayItem, shape: tuple[int, ...], dtype: Any) -> None:
    if tuple(shape) != item.shape or np.dtype(dtype) != item.dtype:
        raise ValueError(
            f"item {name!r}: target is {np.dtype(dtype)}{list(shape)} but the checkpoint holds "
            f"{item.dtype}{list(item.shape)} (ckptio does not cast or reshape)"
        )


def _regions(name: str, item: ArrayItem, target: Any) -> tuple[list[Region], Finish]:
    """Destination regions for one array item, and how to build the leaf once they are filled."""
    if target is None or (isinstance(target, np.ndarray) and not (target.flags.c_contiguous and target.flags.writeable)):
        if target is not None:
            _check(name, item, target.shape, target.dtype)
        dest = np.empty(item.shape, item.dtype)
        return [Region((0,) * len(item.shape), dest)], (lambda: dest[()] if item.scalar else dest)
    if isinstance(target, np.ndarray):
        _check(name, item, target.shape, target.dtype)
        return [Region((0,) * target.ndim, target)], lambda: target
    if isinstance(target, Sharded):
        _check(name, item, target.shape, target.dtype)
        regions, pieces = [], []
        for index, data in target.pieces:
            offs, sizes = index_to_box(index, target.shape)
            ok = isinstance(data, np.ndarray) and data.shape == sizes and data.dtype == item.dtype
            dest = data if ok and data.flags.c_contiguous and data.flags.writeable else np.empty(sizes, item.dtype)
            regions.append(Region(offs, dest))
            pieces.append((index, dest))
        return regions, lambda: Sharded(target.shape, target.dtype, pieces)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return _jax_regions(name, item, target, jax)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(target, torch.Tensor):
        t = target.detach()
        view = torch_to_numpy(t) if t.device.type == "cpu" and t.is_contiguous() else None
        if view is not None:
            _check(name, item, view.shape, view.dtype)
            return [Region((0,) * view.ndim, view)], lambda: target
        _check(name, item, tuple(t.shape), torch_to_numpy(t.new_empty(0, device="cpu")).dtype)
        dest = np.empty(item.shape, item.dtype)
        return [Region((0,) * dest.ndim, dest)], lambda: target.copy_(_numpy_to_torch(dest, torch))
    raise TypeError(f"item {name!r}: unsupported restore target of type {type(target).__name__}")


def _numpy_to_torch(arr: np.ndarray, torch: Any) -> Any:
    name = arr.dtype.name
    if arr.dtype.type.__module__.startswith("ml_dtypes") and hasattr(torch, name):
        return torch.from_numpy(arr.view(np.int16 if arr.dtype.itemsize == 2 else np.uint8)).view(getattr(torch, name))
    return torch.from_numpy(arr)


def _jax_regions(name: str, item: ArrayItem, target: Any, jax: Any) -> tuple[list[Region], Finish]:
    _check(name, item, target.shape, target.dtype)
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        dest = np.empty(item.shape, item.dtype)
        check = _check_jax_keeps(name, dest, jax)
        return [Region((0,) * dest.ndim, dest)], lambda: (check(), jax.numpy.asarray(dest))[1]
    by_box: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
    devices = []
    for device, index in sharding.addressable_devices_indices_map(tuple(item.shape)).items():
        box = index_to_box(index, item.shape)
        if box not in by_box:
            # Page-aligned, so that a CPU device can adopt the buffer without a copy (below).
            by_box[box] = aligned_empty(math.prod(box[1]) * item.dtype.itemsize).view(item.dtype).reshape(box[1])
        devices.append((device, box))
    regions = [Region(box[0], dest) for box, dest in by_box.items()]

    checks = [_check_jax_keeps(name, dest, jax) for dest in by_box.values()]

    def finish() -> Any:
        for check in checks:
            check()
        arrays, adopted = [], set()
        for device, box in devices:
            # One device adopts each buffer; replicas get copies, so donating one never touches another.
            arrays.append(_device_put(jax, by_box[box], device, alias=box not in adopted))
            adopted.add(box)
        return jax.make_array_from_single_device_arrays(tuple(item.shape), sharding, arrays)

    return regions, finish


def _check_jax_keeps(name: str, host: np.ndarray, jax: Any) -> Callable[[], None]:
    """A check, run once ``host`` is filled, that jax keeps its values (64-bit types narrow with x64 off)."""
    narrow = np.dtype(jax.dtypes.canonicalize_dtype(host.dtype))
    if narrow == host.dtype:
        return lambda: None

    def check() -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            back = host.astype(narrow).astype(host.dtype)
        bad = back != host
        if host.dtype.kind in "fc":
            bad &= ~(np.isnan(back) & np.isnan(host))
        if bad.any():
            raise ValueError(
                f"item {name!r}: the checkpoint holds {host.dtype} values such as {host[bad].flat[0]!r} that "
                f"a jax array would silently change ({narrow}: jax_enable_x64 is off); enable jax_enable_x64, "
                "or restore it as numpy (an np.ndarray target)"
            )

    return check


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
    if target is None:
        wanted = {name: None for name in manifest.items}
        structure = manifest.tree
    else:
        leaves, structure = flatten(target, is_leaf=_is_target_leaf)
        wanted = {path_str(p): leaf for p, leaf in leaves}
        missing = [n for n in wanted if n not in manifest.items]
        if missing:
            raise CheckpointNotFoundError(
                f"{where}: the target asks for {missing[:5]} which the checkpoint does not hold "
                f"(it holds {sorted(manifest.items)[:10]}{'...' if len(manifest.items) > 10 else ''})"
            )
    # Objects exist and are as long as the manifest says before anything is allocated from it.
    if not store.host_local:
        run_sync(store.check_objects(manifest, where))
    requests: list[ReadRequest] = []
    finishers: dict[str, Finish] = {}
    for name, tgt in wanted.items():
        item = manifest.items[name]
        if isinstance(item, ValueItem):
            finishers[name] = lambda v=item.value: v
            continue
        regions, finishers[name] = _regions(name, item, tgt)
        for r in regions:
            gaps = coverage_gaps(item, r.offsets, tuple(r.dest.shape))
            if gaps:
                raise CheckpointNotFoundError(f"{where}: item {name!r}: {gaps} elements of the target slice are not saved")
            requests += plan_region(name, item, r, manifest.objects, manifest.block_size)
    run_sync(store.engine.read(requests, progress))
    results = {name: finish() for name, finish in finishers.items()}
    return unflatten(structure, results.__getitem__)


def restore_step(store: CheckpointStore, step: int | None, target: Any = None, *,
                 progress: Progress | None = None) -> Any:
    """Restore ``step`` (None: the newest intact committed step) of ``store``.

    A restore that loses a race with a deletion says so
    (CheckpointNotFoundError "step N was deleted while being restored"); with
    ``step=None`` it then restores the next newest instead.
    """
    tried: list[int] = []
    while True:
        step_dir, manifest = run_sync(store.resolve_manifest(step, skip=tried))
        try:
            return restore_checkpoint(store, manifest, step_dir, target, progress=progress)
        except (FileNotFoundError, IntegrityError) as e:
            if not step_dir:
                raise
            if run_sync(_still_there(store, step_dir, manifest.checkpoint_id)):
                raise  # the checkpoint is there: a missing or damaged object is damage, not a race
            gone = CheckpointNotFoundError(f"{store.where(step_dir)}: step {step_dir} was deleted while being restored")
            if step is not None:
                raise gone from e
            log.warning("%s; restoring the next newest step", gone)
            tried.append(int(step_dir))


async def _still_there(store: CheckpointStore, step_dir: str, checkpoint_id: str) -> bool:
    try:
        return (await store.read_manifest(step_dir)).checkpoint_id == checkpoint_id
    except (FileNotFoundError, ValueError, IntegrityError):
        return False
