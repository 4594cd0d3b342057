"""JSON for manifests: orjson's speed with the standard library's semantics.

A 100k-leaf manifest is ~8 MB of JSON: the standard encoder and decoder took
~0.15 s and ~0.2 s of it on this VM (issue 15), orjson about a tenth. Where the
two differ, the standard library decides, so a manifest means what it meant:

* NaN and infinities are refused when writing (orjson would write ``null``).
  Floats only occur outside a manifest's bulk members (user metadata, the
  timestamp), which the standard encoder checks first: items hold ints and
  strings by construction (a float value is stored as its hex string) and are
  validated before a manifest is committed;
* what orjson cannot encode (ints past 64 bits, str subclasses as keys) or parse
  (ints past 64 bits, lone surrogates, ``NaN`` literals) goes to the standard
  encoder or parser, with its own errors and messages.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "loads"]

# The bulk of a manifest: keys, item rows and the tree, which validation holds to ints and strings.
_BULK = frozenset({"items", "tree", "objects"})


def dumps(doc: Any) -> bytes:
    """Compact JSON of ``doc``; ValueError for NaN or infinity anywhere, as ``allow_nan=False``."""
    if isinstance(doc, dict):
        # Raises ValueError on NaN/inf where floats can be (the rest is small).
        json.dumps({k: v for k, v in doc.items() if k not in _BULK}, allow_nan=False)
        try:
            return orjson.dumps(doc)
        except TypeError:
            pass  # the standard encoder handles (or refuses, naming it) what orjson cannot
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON as ``json.loads`` does (same results, same errors), faster."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
