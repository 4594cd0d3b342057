"""The manifest's limits and the one validator of its integers.

Everything a reader takes from a manifest is bounded before it is used: a
rank, a dimension, a count, a checksum. The bounds live here once, and every
codec checks integers with :func:`check_int` / :func:`check_dims` /
:func:`check_ints`, so a limit changes in one place and an error always reads
the same way ("<where>: <what> must be ...").
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptio.errors import ManifestError

__all__ = [
    "MAX_COUNT",
    "MAX_DIM",
    "MAX_INT_DIGITS",
    "MAX_MANIFEST_BYTES",
    "MAX_NDIM",
    "ORIGINS",
    "U32",
    "check_dims",
    "check_int",
    "check_ints",
]

#: Bytes of a stored manifest (or fragment) a reader accepts.
MAX_MANIFEST_BYTES = 1 << 30
#: Dimensions of an array.
MAX_NDIM = 64
#: Any size, offset or length (bytes or elements): an int64 with room to add two.
MAX_DIM = 1 << 62
#: Entries of any list or object of a manifest (objects, items, shards, packs).
MAX_COUNT = 50_000_000
#: Checksums are crc32c: below this.
U32 = 1 << 32
#: Characters of an int value item (Python refuses longer int <-> str conversions).
MAX_INT_DIGITS = 4000
#: Where an array came from: a hint for adapters ("sharded": a ckptio.Sharded).
ORIGINS = ("numpy", "jax", "torch", "sharded")


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(v: Any, what: str, where: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    """``v`` if it is an int (not a bool) in ``[lo, hi]``; ManifestError naming ``where`` and ``what``."""
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"{where}: {what} must be an integer in [{lo}, {hi}], got {_shown(v)}")
    return v


def check_dims(v: Any, what: str, where: str) -> tuple[int, ...]:
    """A JSON list of at most :data:`MAX_NDIM` dimensions (ints in ``[0, MAX_DIM]``) as a tuple."""
    # The common case in one pass (a manifest of 100k leaves holds ~300k of these lists).
    if type(v) is list and len(v) <= MAX_NDIM and all(type(d) is int and 0 <= d <= MAX_DIM for d in v):
        return tuple(v)
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise ManifestError(f"{where}: {what} must be a list of at most {MAX_NDIM} integers")
    return tuple(check_int(d, what, where) for d in v)


def check_ints(v: Any, what: str, where: str, n: int, lo: int, hi: int) -> np.ndarray:
    """A JSON list of ``n`` ints in ``[lo, hi]`` (``n`` < 0: any length) as int64, checked as a column."""
    if type(v) is not list or (n >= 0 and len(v) != n) or not set(map(type, v)) <= {int}:
        raise ManifestError(f"{where}: {what} must be a list of {f'{n} ' if n >= 0 else ''}integers")
    try:
        arr = np.array(v, dtype=np.int64)
    except OverflowError:
        raise ManifestError(f"{where}: {what} holds an integer out of range") from None
    if arr.size and (arr.min() < lo or arr.max() > hi):
        raise ManifestError(f"{where}: {what} holds an integer outside [{lo}, {hi}]")
    return arr
