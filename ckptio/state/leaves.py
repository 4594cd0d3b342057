"""The leaves of a state as ckptio sees them: which kind a leaf is, and the shards a host holds.

:class:`Sharded` is how a caller hands over (or asks back) the slices of a global array that
this host holds; :class:`StagedArray` and :class:`LeafPack` are an array, or a pack of small
arrays, once staged into host memory the save owns. The predicates say what a leaf is without
importing a framework nobody imported.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["LeafPack", "Sharded", "StagedArray", "TORCH_AS_INT", "index_to_box", "is_jax_array", "is_torch_tensor",
           "plain_cpu_tensor", "torch_to_numpy"]


@dataclasses.dataclass
class Sharded:
    """A global array of which this host holds some slices.

    ``pieces`` are ``(index, data)`` with ``index`` a tuple of slices (as
    numpy indexing would take it) into the global ``shape``. As a restore
    target, ``data`` may be None: the restored Sharded has them filled.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: list[tuple[tuple[slice, ...], np.ndarray | None]]

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        self.dtype = np.dtype(self.dtype)


def index_to_box(
    index: Sequence[slice], shape: Sequence[int], where: str = ""
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A tuple of (step-1) slices into ``shape`` -> ``(offsets, sizes)``; errors name ``where``
    (the leaf's pytree path) and the index."""
    at = f"{where}: index" if where else "index"
    if len(tuple(index)) > len(shape):
        raise ValueError(f"{at} {tuple(index)!r}: more slices than the {len(shape)} dimensions of {list(shape)}")
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    offs, sizes = [], []
    for sl, dim in zip(index, shape):
        if not isinstance(sl, slice):
            raise TypeError(f"{at} {index!r}: only slices are supported")
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"{at} {index!r}: strided slices cannot describe a shard")
        offs.append(start)
        sizes.append(max(0, stop - start))
    return tuple(offs), tuple(sizes)


@dataclasses.dataclass
class StagedArray:
    """An array item as this host stages it: metadata, plus the shards it writes."""

    dtype: np.dtype
    shape: tuple[int, ...]
    scalar: bool
    origin: str
    shards: list[tuple[tuple[int, ...], tuple[int, ...], np.ndarray]]  # offsets, shape, C-contiguous data
    #: Per shard, the tile shape it is stored in (ckptio.engine.tiling), or None for plain C order.
    #: Staging is plain C order either way; the writer cuts tiles out of it off the step's path.
    tiles: list[tuple[int, ...] | None] = dataclasses.field(default_factory=list)

    def tile_of(self, i: int) -> tuple[int, ...] | None:
        return self.tiles[i] if self.tiles else None


#: torch dtypes numpy has no name for (ml_dtypes has), by name, and the torch integer of their size to view them as.
TORCH_AS_INT = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
                "float8_e4m3fnuz": "uint8", "float8_e5m2fnuz": "uint8", "float8_e8m0fnu": "uint8"}


def torch_to_numpy(t: Any) -> np.ndarray:
    """A numpy view of a CPU torch tensor, bfloat16 and float8 included (as ml_dtypes: imported for those only)."""
    name = str(t.dtype).removeprefix("torch.")
    if name in TORCH_AS_INT:
        import ml_dtypes  # ~1.4 s to import: not inside the first float32 save's stall
        import torch

        return t.view(getattr(torch, TORCH_AS_INT[name])).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()


def is_jax_array(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` (False without importing JAX where nobody has)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def is_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (False without importing torch where nobody has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


@dataclasses.dataclass
class LeafPack:
    """Small whole arrays of one dtype staged back to back in one buffer, written as one extent.

    A state's per-layer norms, biases and counters are 10k-100k arrays: staging,
    describing and checksumming them one by one costs tens of microseconds each in
    Python. A pack copies them with one call, becomes one piece of an object, and is
    checksummed per member in one pass; each member is still its own item in the
    manifest (its own extent and checksum), so restores read them like any array.
    One dtype per pack keeps every member aligned to its itemsize (restores view
    them in place) and lets one ``np.concatenate`` copy them all.
    """

    names: list[str]
    arrays: list[np.ndarray]  # the leaves (until filled), any memory layout: packed in C order
    origin: str  # "numpy", "torch" or "jax": what every member was
    ends: list[int]  # each member's end offset in ``buffer``
    buffer: np.ndarray  # uint8, filled by the StagingArea


def plain_cpu_tensor(x: Any) -> bool:
    """A contiguous CPU ``torch.Tensor`` or ``Parameter``, whose numpy view is its own bytes (not a
    DTensor, nor a tensor subclass with storage of its own)."""
    return (is_torch_tensor(x) and type(x).__name__ in ("Tensor", "Parameter") and x.device.type == "cpu"
            and x.is_contiguous())
