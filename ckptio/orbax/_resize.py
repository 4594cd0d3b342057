"""Restoring into another global shape, as Orbax does under ``strict=False``: pad with zeros, or truncate.

Orbax (``ArrayRestoreArgs(global_shape=..., strict=False)``, or
``StandardRestore(item, strict=False)``) lets a restore ask for a global
shape other than the saved one, of the same rank: each dimension is cut at
its end or padded with zeros there. Nothing else changes shape: with
``strict=True`` (Orbax's default) any difference raises, and a different
rank raises whatever ``strict`` says (TensorStore cannot intersect domains
of different ranks, so Orbax refuses it too).

ckptio's core restores exactly the saved shape, so the adapter does the
rest: it asks ckptio only for the part of each target slice that the saved
array covers (a box in saved coordinates: ranged reads of just those bytes)
and copies it into a zero-filled host buffer of the target slice's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ckptio.manifest import ArrayItem

__all__ = ["Box", "box_slices", "covered", "needs_resize", "padded"]

#: A slice of an array as (offsets, sizes).
Box = tuple[tuple[int, ...], tuple[int, ...]]


def needs_resize(name: str, item: ArrayItem, shape: Sequence[int], strict: bool) -> bool:
    """Whether the target ``shape`` differs from the saved one (and may: else ValueError naming the item)."""
    shape = tuple(int(d) for d in shape)
    if shape == item.shape:
        return False
    if len(shape) != len(item.shape):
        # Orbax cannot either: padding and truncating act per dimension, they never reshape.
        raise ValueError(
            f"item {name!r}: target shape {shape} but the checkpoint holds {item.shape}, of another rank; "
            "strict=False pads or truncates dimensions, it does not reshape"
        )
    if strict:
        raise ValueError(
            f"item {name!r}: target shape {shape} but the checkpoint holds {item.shape}; "
            "pass strict=False to pad with zeros or truncate at the end of each dimension (as Orbax does)"
        )
    return True


def covered(box: Box, saved: Sequence[int]) -> Box | None:
    """The part of target slice ``box`` that the saved array (shape ``saved``) holds; None if nothing.

    Both start at the box's offsets: a target slice only ever loses its far end.
    """
    offs, sizes = box
    out = tuple(max(0, min(o + s, d) - o) for o, s, d in zip(offs, sizes, saved))
    if any(s == 0 for s in out):
        return None  # beyond the saved array (or empty): only padding
    return tuple(offs), out


def box_slices(box: Box) -> tuple[slice, ...]:
    """``box`` as the tuple of slices a :class:`ckptio.Sharded` piece takes."""
    return tuple(slice(o, o + s) for o, s in zip(*box))


def padded(sizes: Sequence[int], dtype: np.dtype, part: np.ndarray | None) -> np.ndarray:
    """A zero-filled buffer of ``sizes`` whose leading corner holds ``part`` (the covered values)."""
    out = np.zeros(tuple(sizes), dtype)
    if part is not None:
        out[tuple(slice(0, s) for s in part.shape)] = part
    return out
