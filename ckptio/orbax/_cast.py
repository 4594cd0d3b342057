"""Dtype changes on restore (and on save with ``SaveArgs.dtype``): on the host, checked, never silent.

A dtype changes in two ways:

* **the caller asks for it** (a target of another dtype, ``RestoreArgs.dtype``,
  ``SaveArgs.dtype``): integer and bool targets must hold every value exactly;
  floating targets must keep every finite value finite (rounding is what a
  float cast means, overflow to inf/nan is not);
* **jax forces it**: with ``jax_enable_x64`` off a jax array cannot be 64-bit,
  so an int64 / uint64 / float64 / complex128 item restored as a jax array
  would become 32-bit. That is done only when every value survives exactly;
  otherwise the restore raises, naming the item (jax itself would wrap
  ``2**40`` to ``0`` without a word, and so does stock Orbax).

Casts run on host buffers with numpy, before the device transfer: no jitted
``astype`` (which fails on arrays committed to other devices, and would
first put the unconverted data on the devices).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np

from ckptio.state.cast import cast_checked
from ckptio.state.leaves import Sharded

__all__ = ["cast_checked", "cast_staged", "jax_dtype", "x64_context", "x64_enabled"]


def jax_dtype(dtype: Any) -> np.dtype:
    """The dtype a jax array asked to be ``dtype`` has now (``jax_enable_x64`` decides 64-bit types)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def cast_staged(name: str, staged: Any, dtype: Any) -> Any:
    """A staged leaf (:class:`ckptio.state.leaves.Sharded` of host pieces, or an array) cast to ``dtype``."""
    if isinstance(staged, Sharded):
        pieces = [  # a device snapshot's piece crosses to the host here, for a host cast
            (index, cast_checked(name, np.asarray(p), dtype, asked=True, saving=True)) for index, p in staged.pieces
        ]
        return Sharded(staged.shape, np.dtype(dtype), pieces)
    return cast_checked(name, staged, dtype, asked=True, saving=True)


def x64_enabled() -> bool:
    """Whether jax arrays may be 64-bit on this thread (``jax.enable_x64`` contexts are thread-local)."""
    return jax_dtype(np.int64) == np.int64


def x64_context(on: bool) -> contextlib.AbstractContextManager[Any]:
    """Carry a caller's x64 setting to a worker thread, which would otherwise see the global one."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # an older jax: the experimental name
        enable = jax.experimental.enable_x64
    return enable(on)
