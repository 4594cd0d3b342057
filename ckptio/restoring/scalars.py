"""Python scalar restore targets (int, float, bool, complex, str, bytes): "restore this value, as this type".

A scalar target is checked against what the checkpoint holds before any
byte is read (a 0-d array of a compatible dtype, or a saved value), and the
value read is checked again: a number only widens when it stays exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptio.manifest import ArrayItem
from ckptio.restoring.buffers import Finish, dest_buffer
from ckptio.restoring.reshard import Region
from ckptio.state.cast import is_inexact

__all__ = ["PY_SCALARS", "scalar_regions", "scalar_value"]

#: Python scalar targets: "restore this value, as this type".
PY_SCALARS = (bool, int, float, complex, str, bytes)


def scalar_regions(name: str, item: ArrayItem, target: bool | int | float | complex | str | bytes,
                   ) -> tuple[list[Region], Finish]:
    """A Python scalar target against a saved array: only a 0-d one can be a scalar (a fresh
    flax ``TrainState``'s int ``step`` against the jax array a jitted step saved)."""
    held = f"{item.dtype}{list(item.shape)}"
    have = _python_type(item.dtype)
    # Refused before any byte is read: the shape and dtype alone say whether it can be one.
    if item.shape != () or have is None or not _scalar_fits(_scalar_type(target), have):
        raise _scalar_mismatch(name, target, held)
    dest = dest_buffer((), item.dtype)
    return [Region((), dest)], lambda: scalar_value(name, have(dest[()]), held, target)


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
    return next(t for t in PY_SCALARS if isinstance(target, t))  # bool first: a bool is an int too


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


def scalar_value(name: str, value: Any, held: str, target: Any) -> Any:
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

