"""Value items: the small non-array leaves a manifest holds inline, as JSON.

``{"kind": "value", "type": <none|bool|int|float|str|bytes>, "value": ...}``:
ints as decimal strings (JSON numbers lose precision past 2**53), floats as
their hex form (exact, and NaN/inf survive), bytes as base64.
"""

from __future__ import annotations

import base64
from typing import Any

from ckptio.errors import ManifestError
from ckptio.manifest.limits import MAX_INT_DIGITS

__all__ = ["decode_value", "encode_value"]


def encode_value(value: Any, where: str) -> dict[str, Any]:
    """The JSON form of a value leaf; TypeError naming ``where`` for anything else."""
    if value is None:
        return {"kind": "value", "type": "none"}
    if isinstance(value, bool):
        return {"kind": "value", "type": "bool", "value": value}
    if isinstance(value, int):
        try:
            digits = str(value)
        except ValueError:  # past Python's int-to-str limit
            digits = "x" * MAX_INT_DIGITS
        if len(digits) >= MAX_INT_DIGITS:  # a reader refuses it: refuse it before anything is written
            raise ValueError(f"{where}: int of {value.bit_length()} bits is too large to store "
                             f"(at most {MAX_INT_DIGITS - 1} characters)")
        return {"kind": "value", "type": "int", "value": digits}
    if isinstance(value, float):
        return {"kind": "value", "type": "float", "value": value.hex()}
    if isinstance(value, str):
        return {"kind": "value", "type": "str", "value": value}
    if isinstance(value, (bytes, bytearray)):
        return {"kind": "value", "type": "bytes", "value": base64.b64encode(bytes(value)).decode()}
    raise TypeError(f"{where}: leaf of type {type(value).__name__} is not a value ckptio can store")


def decode_value(d: dict[str, Any], where: str) -> Any:
    """The value of a value item's JSON; ManifestError naming ``where`` if it is malformed."""
    kind, v = d.get("type"), d.get("value")
    try:
        if kind == "none":
            return None
        if kind == "bool" and isinstance(v, bool):
            return v
        if kind == "int" and isinstance(v, str) and len(v) < MAX_INT_DIGITS:
            return int(v)
        if kind == "float" and isinstance(v, str):
            return float.fromhex(v)
        if kind == "str" and isinstance(v, str):
            return v
        if kind == "bytes" and isinstance(v, str):
            return base64.b64decode(v, validate=True)
    except ValueError as e:
        raise ManifestError(f"{where}: bad {kind} value: {e}") from e
    raise ManifestError(f"{where}: malformed value item {str(d)[:100]!r}")
