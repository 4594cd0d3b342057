"""Destination buffers of a restore and the checks on a target's shape and dtype.

Bytes always land in buffers of the *saved* dtype; a target of another dtype
is a request to cast (as Orbax's restore does), run on the host once the
bytes are in and checked by :func:`ckptio.state.cast.cast_checked`. A shape is
never changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.manifest import ArrayItem
from ckptio.state.cast import cast_checked, is_numeric
from ckptio.system import fresh_pages

__all__ = ["Finish", "cast", "check_target", "dest_buffer"]

#: Builds one restored leaf once its destination buffers are filled.
Finish = Callable[[], Any]


def check_target(name: str, item: ArrayItem, shape: tuple[int, ...], dtype: Any) -> np.dtype:
    """The dtype a target of ``shape`` and ``dtype`` asks for; ValueError if the shape differs.

    A target of another dtype is a request to cast (as Orbax's restore does; checked by
    :func:`ckptio.state.cast.cast_checked` once the bytes are in); a shape is never changed.
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


def cast(name: str, host: np.ndarray, want: np.dtype) -> np.ndarray:
    """``host`` as ``want``, a cast the target asked for (refused, naming ``name``, where it changes a value)."""
    return cast_checked(name, host, want, asked=True)


def dest_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A restore destination: uninitialised, C-contiguous, page-aligned when large. Private 4 KiB
    pages, not ``np.empty``'s transparent huge pages, whose first touch cost a cold restore
    0.44-2.3 s per GiB here as the kernel compacted memory or not (backends/_pages.py)."""
    return fresh_pages(math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
