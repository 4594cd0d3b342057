"""Checked dtype changes on host buffers: a cast never changes a value silently.

Framework-neutral (numpy and ml_dtypes only), so the native restore and the
Orbax adapter share one rule:

* **asked for** (a restore target of another dtype, Orbax's
  ``RestoreArgs.dtype`` / ``SaveArgs.dtype``): integer and bool targets must
  hold every value exactly; floating targets may round (that is what a float
  cast means, e.g. float32 -> bfloat16) but must keep every finite value
  finite, and a complex value may not lose its imaginary part;
* **forced** (``asked=False``: jax with ``jax_enable_x64`` off cannot hold a
  64-bit array): every value must survive exactly.

Anything else raises ValueError naming the item, the first value that does
not fit and its index. Shapes are never changed here.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

__all__ = ["cast_checked", "is_inexact", "is_numeric"]


def is_inexact(dtype: Any) -> bool:
    """Floating or complex, ml_dtypes' bfloat16 / float8 types included (numpy sees those as 'V')."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return True
    if dtype.kind != "V":
        return False
    import ml_dtypes  # imported once a 'V' dtype is seen: see ckptio.state.dtypes

    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False  # int4 / uint4 and other non-float extension types
    return True


def is_numeric(dtype: Any) -> bool:
    """bool, integer, floating or complex (ml_dtypes' types included): the dtypes a cast may join."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or (dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes"))


def _mismatch(src: np.ndarray, out: np.ndarray, exact: bool) -> np.ndarray:
    """Mask of the values of ``src`` that ``out`` (its cast) does not hold."""
    if exact or not is_inexact(out.dtype):
        with np.errstate(invalid="ignore", over="ignore"):
            back = out.astype(src.dtype)
        differs = np.asarray(back != src)
        if is_inexact(src.dtype):
            differs &= ~(np.isnan(back) & np.isnan(src))  # a NaN that stays NaN survived
        return differs
    bad = np.isfinite(src) & ~np.isfinite(out)  # overflow to inf (or to nan, for float8 types)
    if np.iscomplexobj(src) and not np.iscomplexobj(out):
        bad |= np.imag(src) != 0  # the imaginary part would be dropped
    return bad


def cast_checked(
    name: str, values: np.ndarray, dtype: Any, *, asked: bool, saving: bool = False
) -> np.ndarray:
    """``values`` as ``dtype``, or ValueError naming item ``name`` if ``dtype`` cannot hold them.

    ``asked``: the caller asked for ``dtype`` (a float target may round);
    False when jax forces the change (every value must survive exactly).
    ``saving``: the values come from the state being saved, not from a checkpoint.
    Returns ``values`` itself when the dtype is already ``dtype``.
    """
    values = np.asarray(values)
    dtype = np.dtype(dtype)
    if values.dtype == dtype:
        return values
    if not (is_numeric(values.dtype) and is_numeric(dtype)):
        raise ValueError(f"item {name!r}: {values.dtype} cannot be cast to {dtype} (only numeric dtypes are cast)")
    with np.errstate(invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)  # checked below
        out = values.astype(dtype)
    bad = _mismatch(values, out, exact=not asked)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        first = values[where].item()
        if asked:
            why = f"the requested dtype {dtype} cannot hold them"
            fix = "ask for a dtype that holds them"
        else:
            why = f"as a jax array it would be {dtype}: jax_enable_x64 is off, and {dtype} cannot hold them"
            fix = "enable jax_enable_x64, or restore it as numpy (an np.ndarray target)"
        raise ValueError(
            f"item {name!r}: the {'state' if saving else 'checkpoint'} holds {values.dtype} values such as {first!r} "
            f"(at index {list(where)}), but {why}; {fix}"
        )
    return out
