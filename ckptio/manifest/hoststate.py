"""Per-host state items (format 8): each host's own small state, inline in the manifest, as JSON.

An item of kind ``per_host`` holds one state per host that saved it
(``ckptio.PerHost`` leaves, data loaders: see :mod:`ckptio.state.perhost`)::

    {"kind": "per_host", "states": {"0": <state>, "1": <state>, ...}}

keyed by host rank, every host from 0 to ``num_hosts - 1`` present. A host's
record holds only its own entry; the coordinator's merge joins them. A state
is a small pytree written as tagged JSON, never pickle:

* a value (None, bool, int, float, str, bytes): :func:`~.values.encode_value`;
* ``{"kind": "list" | "tuple", "items": [...]}``;
* ``{"kind": "dict", "items": [[<key as a value>, <state>], ...]}`` (str or int keys, in order);
* ``{"kind": "ndarray", "dtype", "shape", "data": <base64>, "origin": "numpy" | "numpy-scalar" | "torch"}``.

A reader that predates format 8 refuses such a manifest by its version.
"""

from __future__ import annotations

import base64
import importlib
import json
import math
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from ckptio.errors import ManifestError
from ckptio.manifest.values import decode_value, encode_value
from ckptio.state.dtypes import check_dtype, decode_dtype, encode_dtype

__all__ = ["MAX_STATE_BYTES", "HostStateItem", "StagedHostState", "decode_state", "encode_state", "has_host_states", "host_state_item",
           "host_state_json",
           "merge_host_state", "staged_host_state"]

_MAX_DEPTH = 64
#: The largest JSON form of one host's state (it is part of the manifest every restore reads).
MAX_STATE_BYTES = 1 << 20


class StagedHostState:
    """One host's state of one per-host leaf, as staged for its record (already JSON: a snapshot)."""

    __slots__ = ("doc", "host")

    def __init__(self, host: int, doc: Any) -> None:
        self.host, self.doc = host, doc

    def record(self) -> dict[str, Any]:
        """This host's entry of the item, as its record holds it."""
        return {"kind": "per_host", "states": {str(self.host): self.doc}}


class HostStateItem:
    """A per-host item read from a manifest: every saved host's state, decoded on use."""

    __slots__ = ("docs",)

    def __init__(self, docs: list[Any]) -> None:
        self.docs = docs

    @property
    def num_hosts(self) -> int:
        return len(self.docs)

    def state(self, host: int, where: str) -> Any:
        """Host ``host``'s saved state; ManifestError naming ``where`` if it is malformed."""
        return decode_state(self.docs[host], f"{where} (host {host})")


def staged_host_state(where: str, state: Any, host: int) -> StagedHostState:
    """Host ``host``'s ``state`` of the per-host leaf at ``where``, as JSON now (a snapshot); ValueError
    if it is larger than :data:`MAX_STATE_BYTES`, TypeError naming the path of a leaf it cannot hold."""
    doc = encode_state(state, where)
    size = len(json.dumps(doc, separators=(",", ":")))
    if size > MAX_STATE_BYTES:
        raise ValueError(f"{where}: this host's state is {size} bytes as JSON, over the {MAX_STATE_BYTES} a per-host "
                         "state may hold (it is inline in the manifest); put large arrays in the tree instead")
    return StagedHostState(host, doc)


def host_state_json(item: HostStateItem) -> dict[str, Any]:
    """The manifest's JSON of a per-host item (the docs as read: re-encoding changes no byte)."""
    return {"kind": "per_host", "states": {str(h): d for h, d in enumerate(item.docs)}}


def host_state_item(raw: dict[str, Any], where: str) -> HostStateItem:
    """A per-host item from its JSON; ManifestError naming ``where`` unless hosts 0..n-1 each have one."""
    states = raw.get("states")
    if not isinstance(states, dict) or not states:
        raise ManifestError(f"{where}: a per_host item needs a non-empty 'states' object")
    if sorted(states) != sorted(str(h) for h in range(len(states))):
        raise ManifestError(f"{where}: a per_host item must hold hosts 0..{len(states) - 1}, "
                            f"it holds {sorted(states)[:8]}")
    return HostStateItem([states[str(h)] for h in range(len(states))])


def merge_host_state(items: dict[str, Any], name: str, it: dict[str, Any], where: str) -> None:
    """Adds one host's per-host entry ``it`` of item ``name`` to the merged ``items``."""
    mine = items.setdefault(name, {"kind": "per_host", "states": {}})
    if mine.get("kind") != "per_host":
        raise ManifestError(f"{where}: item {name!r} is per-host on one host and not on another")
    for host, doc in it["states"].items():
        if host in mine["states"]:
            raise ManifestError(f"{where}: item {name!r}: host {host} sent its state twice")
        mine["states"][host] = doc


def has_host_states(items: Iterable[Any]) -> bool:
    """Whether any of these item JSONs is per-host (the document is then format 8)."""
    return any(type(it) is dict and it.get("kind") == "per_host" for it in items)


# -- a state as JSON -----------------------------------------------------------------------------

def encode_state(state: Any, where: str, depth: int = 0) -> Any:
    """``state`` (a small pytree) as tagged JSON; TypeError naming the path ``where`` of a leaf it cannot hold."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: state is nested deeper than {_MAX_DEPTH} levels")
    if state is None or isinstance(state, (bool, int, float, str, bytes, bytearray)):
        return encode_value(state, where)
    if isinstance(state, dict):
        out = []
        for k, v in state.items():
            if type(k) not in (str, int):
                raise TypeError(f"{where}: dict key {k!r} is a {type(k).__name__}; a per-host state's keys "
                                "must be str or int")
            out.append([encode_value(k, where), encode_state(v, f"{where}/{k}", depth + 1)])
        return {"kind": "dict", "items": out}
    if type(state) in (list, tuple):
        return {"kind": type(state).__name__,
                "items": [encode_state(v, f"{where}/{i}", depth + 1) for i, v in enumerate(state)]}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(state, torch.Tensor):
        return _array_json(_tensor_numpy(state, where), "torch", where)
    if isinstance(state, (np.ndarray, np.generic)):
        return _array_json(np.asarray(state), "numpy-scalar" if isinstance(state, np.generic) else "numpy", where)
    raise TypeError(f"{where}: a per-host state cannot hold a {type(state).__module__}.{type(state).__qualname__} "
                    "(it takes dicts, lists, tuples, None, bool, int, float, str, bytes, numpy arrays and "
                    "torch tensors)")


def _tensor_numpy(t: Any, where: str) -> np.ndarray:
    try:
        return t.detach().cpu().contiguous().numpy()
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"{where}: a {t.dtype} tensor has no numpy form for a per-host state: {e}") from None


def _array_json(arr: np.ndarray, origin: str, where: str) -> dict[str, Any]:
    check_dtype(arr.dtype, where)
    data = np.ascontiguousarray(arr).tobytes()
    return {"kind": "ndarray", "dtype": encode_dtype(arr.dtype), "shape": list(arr.shape),
            "data": base64.b64encode(data).decode(), "origin": origin}


def decode_state(doc: Any, where: str, depth: int = 0) -> Any:
    """The state of its tagged JSON (:func:`encode_state`); ManifestError naming ``where`` if malformed."""
    if type(doc) is not dict or depth > _MAX_DEPTH:
        raise ManifestError(f"{where}: malformed per-host state {str(doc)[:80]!r}")
    kind, body = doc.get("kind"), doc.get("items")
    if kind == "value":
        return decode_value(doc, where)
    if kind in ("list", "tuple") and type(body) is list:
        seq = [decode_state(v, where, depth + 1) for v in body]
        return seq if kind == "list" else tuple(seq)
    if kind == "dict" and type(body) is list:
        out: dict[Any, Any] = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ManifestError(f"{where}: malformed dict entry {str(pair)[:80]!r}")
            out[decode_value(pair[0], where)] = decode_state(pair[1], where, depth + 1)
        return out
    if kind == "ndarray":
        return _array_of(doc, where)
    raise ManifestError(f"{where}: malformed per-host state {str(doc)[:80]!r}")


def _array_of(doc: dict[str, Any], where: str) -> Any:
    try:
        dtype = decode_dtype(doc["dtype"], where)
        shape = tuple(int(n) for n in doc["shape"])
        data = base64.b64decode(doc["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where}: malformed array in a per-host state: {e}") from e
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise ManifestError(f"{where}: an array of {dtype}{list(shape)} holds {len(data)} bytes")
    arr = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    origin = doc.get("origin")
    if origin == "numpy-scalar":
        return arr[()]
    if origin == "torch":  # saved from a torch tensor (a loader's generator state): restored as one
        torch = sys.modules.get("torch") or importlib.import_module("torch")
        return torch.from_numpy(arr)
    return arr
