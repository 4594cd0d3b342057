"""A read-only zarr v3 store over a committed ckptio checkpoint.

``zarr.open_group(store=ckptio.zarr_store(url))`` lists every item; reading
``group["params/w"][10:20]`` fetches only the chunks that slice touches, as
ranged reads through the ckptio engine and backend, checksums verified.

Chunks: each array gets a regular chunk grid whose chunk size, per
dimension, is the greatest common divisor of all its saved shard boundaries
(and its length). Where the saved shards form a regular grid, a chunk *is*
a shard; where they do not (uneven splits), chunks are the largest boxes
that still lie inside one saved shard each, so every chunk is still one
ranged read of one shard. Should that grid exceed a million chunks, the
array is served as a single chunk (correct, but reads the whole array).

Dtypes: zarr v3's core numeric types map one to one. bfloat16 and float8
arrays are served as ``uint16`` / ``uint8`` with the real dtype in the
array attributes (``ckptio_dtype``; view them with ml_dtypes). Others
(datetime, strings, structured, long double, int4) are not exposed: they are
listed in the root attributes under ``ckptio_unsupported``. Python values
(step, config) are in the root attributes under ``ckptio_values``.

Tensorstore: not supported. Its zarr3 driver reads chunks as whole keys of
a kvstore (or shards with a trailing index); ckptio objects pack many
shards with block checksums, and tensorstore cannot be pointed at a Python
store, so describing them would need a copy.
"""

from __future__ import annotations

import base64
import json
import math
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from ckptio.engine import gather_or_cancel, run_sync
from ckptio.manifest import ArrayItem, Manifest, ValueItem
from ckptio.manifest.hoststate import HostStateItem
from ckptio.restoring.reshard import Region, plan_region, shard_grid
from ckptio.store import CheckpointStore

__all__ = ["CheckpointZarrStore", "zarr_store"]

_ZARR_TYPES = {
    "b": {1: "bool"}, "i": {1: "int8", 2: "int16", 4: "int32", 8: "int64"},
    "u": {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"},
    "f": {2: "float16", 4: "float32", 8: "float64"}, "c": {8: "complex64", 16: "complex128"},
}
_MAX_CHUNKS = 1 << 20


def _zarr_type(dtype: np.dtype) -> tuple[str, dict[str, Any]] | None:
    """The zarr data type serving ``dtype`` and extra attributes, or None if it cannot be served."""
    if dtype.type.__module__.startswith("ml_dtypes"):
        if dtype.name == "bfloat16" or dtype.name.startswith("float8"):
            return ("uint16" if dtype.itemsize == 2 else "uint8"), {"ckptio_dtype": dtype.name}
        return None
    name = _ZARR_TYPES.get(dtype.kind, {}).get(dtype.itemsize)
    return (name, {}) if name and dtype.fields is None else None


def _chunk_shape(item: ArrayItem) -> tuple[int, ...]:
    shape = shard_grid(item)
    if math.prod(-(-n // c) for n, c in zip(item.shape, shape)) > _MAX_CHUNKS:
        return tuple(max(n, 1) for n in item.shape)
    return tuple(shape)


def _fill_value(zarr_type: str) -> Any:
    if zarr_type == "bool":
        return False
    if zarr_type.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if zarr_type.startswith("float") else 0


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _value_json(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"bytes_b64": base64.b64encode(v).decode()}
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


class CheckpointZarrStore(Store):
    """Read-only zarr v3 view of one committed checkpoint (see the module docstring)."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, store: CheckpointStore, step_dir: str, manifest: Manifest) -> None:
        super().__init__(read_only=True)
        self._store, self._step_dir, self._m = store, step_dir, manifest
        self._meta: dict[str, bytes] = {}
        self._arrays: dict[str, tuple[ArrayItem, tuple[int, ...], np.dtype]] = {}
        self._build()

    def _build(self) -> None:
        values, unsupported = {}, []
        groups: set[str] = {""}
        for name, item in self._m.items.items():
            if isinstance(item, ValueItem):
                values[name] = _value_json(item.value)
                continue
            if isinstance(item, HostStateItem):  # one state per host: no array to serve
                unsupported.append(name)
                continue
            served = _zarr_type(item.dtype)
            if served is None or name == "":
                unsupported.append(name)
                continue
            zarr_type, attrs = served
            chunks = _chunk_shape(item)
            parts = name.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
            endian = "big" if item.dtype.byteorder == ">" else "little"
            self._meta[f"{name}/zarr.json"] = _json({
                "zarr_format": 3, "node_type": "array", "shape": list(item.shape), "data_type": zarr_type,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                "fill_value": _fill_value(zarr_type),
                "codecs": [{"name": "bytes", "configuration": {"endian": endian}}],
                "attributes": {**attrs, "ckptio_shards": len(item.shards)},
            })
            self._arrays[name] = (item, chunks, item.dtype)
        for g in groups:
            attrs = {"ckptio_step": self._m.step, "ckptio_values": values, "ckptio_unsupported": unsupported} if g == "" else {}
            self._meta[f"{g}/zarr.json" if g else "zarr.json"] = _json(
                {"zarr_format": 3, "node_type": "group", "attributes": attrs}
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointZarrStore) and (other._store.url, other._step_dir) == (
            self._store.url, self._step_dir)

    def __repr__(self) -> str:
        return f"CheckpointZarrStore({self._store.where(self._step_dir)!r})"

    # -- reading ---------------------------------------------------------

    def _chunk(self, key: str) -> tuple[str, tuple[int, ...]] | None:
        """``"params/w/c/1/0"`` -> ("params/w", (1, 0)), if it names a chunk of a served array."""
        parts = key.split("/")
        for i in range(len(parts) - 1, -1, -1):
            if parts[i] != "c":
                continue
            name, rest = "/".join(parts[:i]), parts[i + 1 :]
            if name in self._arrays and all(p.isdigit() for p in rest):
                item, chunks, _ = self._arrays[name]
                idx = tuple(int(p) for p in rest)
                ok = len(idx) == len(chunks) and all(j < -(-n // c) for j, n, c in zip(idx, item.shape, chunks))
                return (name, idx) if ok else None
        return None

    async def _read_chunk(self, name: str, idx: tuple[int, ...]) -> bytes:
        item, chunks, dtype = self._arrays[name]
        offsets = tuple(i * c for i, c in zip(idx, chunks))
        shape = tuple(min(c, n - o) for c, n, o in zip(chunks, item.shape, offsets))
        dest = np.zeros(chunks, dtype)
        region = Region(offsets, dest if shape == chunks else np.empty(shape, dtype))
        await self._store.engine.read(plan_region(name, item, region, self._m.objects, self._m.block_size))
        if region.dest is not dest:
            dest[tuple(slice(0, n) for n in shape)] = region.dest
        return dest.tobytes()

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        if key in self._meta:
            data = self._meta[key]
        else:
            found = self._chunk(key)
            if found is None:
                return None
            data = await self._read_chunk(*found)
        return prototype.buffer.from_bytes(_slice(data, byte_range))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return await gather_or_cancel(self.get(k, prototype, r) for k, r in key_ranges)

    async def exists(self, key: str) -> bool:
        return key in self._meta or self._chunk(key) is not None

    # -- listing ---------------------------------------------------------

    def _keys(self) -> Iterable[str]:
        yield from self._meta
        for name, (item, chunks, _) in self._arrays.items():
            grid = [range(-(-n // c)) for n, c in zip(item.shape, chunks)]
            for idx in np.ndindex(*(len(r) for r in grid)) if grid else [()]:
                yield f"{name}/c" + "".join(f"/{i}" for i in idx)

    async def list(self) -> AsyncIterator[str]:
        for k in self._keys():
            yield k

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for k in self._keys():
            if k.startswith(prefix):
                yield k

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set()
        for k in self._keys():
            if k.startswith(base):
                child = k[len(base):].split("/", 1)[0]
                if child not in seen:
                    seen.add(child)
                    yield child

    # -- writing: refused ------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        raise PermissionError(f"{self!r} is read-only: cannot set {key!r}")

    async def delete(self, key: str) -> None:
        raise PermissionError(f"{self!r} is read-only: cannot delete {key!r}")


def _slice(data: bytes, r: ByteRequest | None) -> bytes:
    if r is None:
        return data
    if isinstance(r, RangeByteRequest):
        return data[r.start : r.end]
    if isinstance(r, OffsetByteRequest):
        return data[r.offset :]
    if isinstance(r, SuffixByteRequest):
        return data[-r.suffix :] if r.suffix else b""
    raise TypeError(f"unsupported byte request {r!r}")


def zarr_store(url: str | os.PathLike[str], step: int | None = None, **store_options: Any) -> CheckpointZarrStore:
    """A read-only zarr v3 store over the checkpoint at ``url`` (newest committed step by default)."""
    store = CheckpointStore(url, **store_options)
    step_dir = run_sync(store.resolve(step))
    return CheckpointZarrStore(store, step_dir, run_sync(store.read_manifest(step_dir)))
