"""Dtype names in the manifest: an allow-list, never pickle.

A dtype is written as numpy's ``dtype.str`` (``'<f4'``, ``'|b1'``,
``'<M8[ns]'``, ``'|S5'``, ``'<U3'``, ``'|V8'``), as an ml_dtypes name
(``'bfloat16'``, ``'float8_e4m3fn'``, ...), or, for structured dtypes, as
``{"struct": [[name, dtype, shape], ...]}``. Object dtypes are refused
everywhere: they would need pickle.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

__all__ = ["ML_DTYPES", "check_dtype", "decode_dtype", "encode_dtype"]

# ml_dtypes is imported only when one of its dtypes is decoded: its import costs ~1.4 s here
# (numpy 2.4), which every `import ckptio` and every CLI call would otherwise pay.
_ML_NAMES: tuple[str, ...] = (
        "bfloat16",
        "float8_e3m4",
        "float8_e4m3",
        "float8_e4m3b11fnuz",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "float4_e2m1fn",
        "int2",
        "int4",
        "uint2",
        "uint4",
)


@functools.cache
def _ml_dtypes() -> frozenset[str]:
    """The names of :data:`_ML_NAMES` that the installed ml_dtypes provides."""
    import ml_dtypes

    return frozenset(name for name in _ML_NAMES if hasattr(ml_dtypes, name))


def __getattr__(name: str) -> Any:
    if name == "ML_DTYPES":  # ml_dtypes names accepted in manifests (those this ml_dtypes provides)
        return _ml_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_PLAIN = re.compile(r"^[<>|=][biufcSUV]\d{1,9}$|^[<>|=][Mm]8(\[\d*(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?$")
_MAX_FIELDS = 4096


def check_dtype(dtype: np.dtype, where: str) -> None:
    """Raise TypeError naming ``where`` if ``dtype`` cannot be saved without pickle."""
    if dtype.hasobject:
        raise TypeError(f"{where}: dtype {dtype} holds Python objects, which ckptio does not pickle")


def encode_dtype(dtype: np.dtype) -> str | dict[str, Any]:
    """The manifest form of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.fields is not None:
        return {"struct": [[name, encode_dtype(dtype.fields[name][0].base), list(dtype.fields[name][0].shape)]
                           for name in dtype.names or ()], "itemsize": dtype.itemsize,
                "offsets": [dtype.fields[name][1] for name in dtype.names or ()]}
    if dtype.type.__module__.startswith("ml_dtypes"):
        return dtype.name
    if dtype.subdtype is not None:
        raise TypeError(f"sub-array dtype {dtype} outside a structure is not an array dtype")
    return dtype.str


def decode_dtype(spec: Any, where: str = "manifest") -> np.dtype:
    """Inverse of :func:`encode_dtype`; anything off the allow-list raises ValueError naming ``where``."""
    if isinstance(spec, str):
        if spec in _ML_NAMES and spec in _ml_dtypes():
            import ml_dtypes

            return np.dtype(getattr(ml_dtypes, spec))
        if _PLAIN.match(spec):
            return np.dtype(spec)
        raise ValueError(f"{where}: dtype {spec!r} is not on ckptio's allow-list")
    if isinstance(spec, dict) and isinstance(spec.get("struct"), list) and len(spec["struct"]) <= _MAX_FIELDS:
        names: list[str] = []
        formats: list[Any] = []
        for field in spec["struct"]:
            if not (isinstance(field, list) and len(field) == 3 and isinstance(field[0], str)
                    and isinstance(field[2], list) and all(isinstance(d, int) and 0 <= d < 2**31 for d in field[2])):
                raise ValueError(f"{where}: malformed structured dtype field {field!r}")
            names.append(field[0])
            base = decode_dtype(field[1], where)
            formats.append((base, tuple(field[2])) if field[2] else base)
        offsets = spec.get("offsets")
        itemsize = spec.get("itemsize")
        if not (isinstance(offsets, list) and len(offsets) == len(names) and isinstance(itemsize, int)):
            raise ValueError(f"{where}: structured dtype without offsets/itemsize")
        try:
            return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: invalid structured dtype: {e}") from e
    raise ValueError(f"{where}: dtype {spec!r} is not on ckptio's allow-list")
