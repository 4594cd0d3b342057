"""Orbax PyTree checkpoint directories (``StandardCheckpointer`` layout) <-> ckptio, streaming.

**Orbax -> ckptio** (:func:`orbax_to_ckptio`): the tree comes from Orbax's
own metadata (``PyTreeCheckpointHandler.metadata``, plus ``_METADATA`` for
each leaf's saved type); each array is opened with the TensorStore spec
Orbax itself reads it with (``build_array_read_spec``), and read chunk by
chunk -- Orbax's chunks are its saved shards -- into a
:class:`ckptio.saving.stream.StreamWriter`, so the ckptio checkpoint keeps the
saved sharding as its shards. Chunks larger than ``block_bytes`` are read as
row blocks. Scalars and strings become ckptio values. The manifest carries
the ``ckptio.orbax`` leaf kinds, so ``ckptio.orbax.Restore`` and
``ckptio.restore`` both read the result.

**ckptio -> Orbax** (:func:`ckptio_to_orbax`): Orbax's public save API
(``PyTreeSave``) takes the whole tree of materialised arrays, so it cannot
stream as such. Instead the stock ``PyTreeCheckpointHandler`` (the one
``StandardCheckpointHandler`` wraps, with the same defaults) saves a tree
whose array leaves are lazy handles, with a ``TypeHandler`` for them that
reports the stock ``typestr`` (``jax.Array`` / ``np.ndarray``) and, inside
Orbax's commit future, opens each array with the spec Orbax's own handlers
write with (``build_array_write_spec``) and writes it block by block --
each block read from ckptio just before it is written. Orbax does
everything else (tree metadata, OCDBT merge, ``_CHECKPOINT_METADATA``,
the atomic rename), so ``ocp.StandardCheckpointer().restore(dst)`` reads the
result with stock code. Memory: about two blocks at a time. The chunk grid is
the ckptio shards' common grid (cut to ``block_bytes``). jax arrays restore
on one device by default (the saved mesh is not in a ckptio manifest);
pass an abstract target with a sharding to restore them sharded.

Both directions use Orbax internals that the stock handlers use
(``orbax.checkpoint._src.serialization``); they are checked against
orbax-checkpoint 0.12.8 by tests/convert/test_convert.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckptio.engine import Progress, run_sync, submit
from ckptio.manifest import ArrayItem, Manifest, ValueItem
from ckptio.manifest.hoststate import HostStateItem
from ckptio.restoring.reshard import Region, plan_region, shard_grid
from ckptio.saving.stream import StreamWriter
from ckptio.state.tree import flatten, path_str, unflatten
from ckptio.store import CheckpointStore

__all__ = ["ckptio_to_orbax", "find_pytree_dir", "orbax_to_ckptio"]

log = logging.getLogger("ckptio.convert")

PYTREE_METADATA = "_METADATA"
META_KEY = "ckptio.orbax"  # = ckptio.orbax._tree.META_KEY (not imported: it would import jax early)


def find_pytree_dir(path: str | os.PathLike[str]) -> str:
    """The Orbax PyTree directory at ``path``: itself, or its one item directory (``<step>/default``)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, PYTREE_METADATA)):
        return path
    subs = (
        [d for d in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, d, PYTREE_METADATA))]
        if os.path.isdir(path)
        else []
    )
    if len(subs) == 1:
        return os.path.join(path, subs[0])
    raise FileNotFoundError(
        f"{path} is not an Orbax PyTree checkpoint (no {PYTREE_METADATA})"
        + (f"; it holds several items {subs}: name one" if subs else "")
    )


def _boxes(
    shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, block_bytes: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The chunk grid of ``shape`` in C order; a chunk above ``block_bytes`` cut into row blocks."""
    if not shape:
        yield (), ()
        return
    if math.prod(shape) == 0:
        return
    grid = [range(0, n, c) for n, c in zip(shape, chunk)]
    for offs in np.ndindex(*(len(g) for g in grid)):
        lo = tuple(g[i] for g, i in zip(grid, offs))
        size = tuple(min(c, n - o) for c, n, o in zip(chunk, shape, lo))
        row = math.prod(size[1:]) * itemsize
        rows = max(1, block_bytes // max(row, 1))
        for r in range(0, size[0], rows):
            yield (lo[0] + r, *lo[1:]), (min(rows, size[0] - r), *size[1:])


def _index(offs: tuple[int, ...], size: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offs, size))


# -- Orbax -> ckptio -------------------------------------------------------


def _saved_types(pytree_dir: str) -> tuple[dict[tuple[str, ...], dict[str, Any]], bool, bool]:
    """Each leaf's value metadata by path (``_METADATA``), and whether it is OCDBT / zarr3."""
    with open(os.path.join(pytree_dir, PYTREE_METADATA)) as f:
        doc = json.load(f)
    out = {}
    for entry in doc.get("tree_metadata", {}).values():
        parts = tuple(str(k["key"]) for k in entry.get("key_metadata", []))
        out[parts] = entry.get("value_metadata", {})
    return out, bool(doc.get("use_ocdbt", True)), bool(doc.get("use_zarr3", False))


def orbax_to_ckptio(
    src: str | os.PathLike[str],
    dst: CheckpointStore,
    step: int | None = None,
    *,
    block_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> Manifest:
    """Convert the Orbax PyTree checkpoint at ``src`` into a ckptio checkpoint (``dst``, ``step``)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    from orbax.checkpoint._src.serialization import types as ocp_types

    pdir = os.path.abspath(find_pytree_dir(src))
    saved, use_ocdbt, use_zarr3 = _saved_types(pdir)
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(pdir)).tree
    leaves, structure = flatten(tree, is_leaf=lambda x: isinstance(x, ocp.metadata.Metadata) or x is None)
    ctx = ts_utils.get_ts_context(use_ocdbt=use_ocdbt)
    writer = StreamWriter(
        dst, step, batch_bytes=block_bytes, inflight_bytes=2 * block_bytes, progress=progress
    )
    kinds: dict[str, Any] = {}
    strings: dict[str, Any] | None = None
    try:
        for path, leaf in leaves:
            name = path_str(path)
            vtype = saved.get(tuple(str(p) for p in path), {}).get("value_type")
            if leaf is None or not isinstance(leaf, ocp.metadata.Metadata):
                writer.add_value(name, None)
                continue
            if isinstance(leaf, ocp.metadata.StringMetadata):
                if strings is None:
                    with open(os.path.join(pdir, "_strings.json")) as f:
                        strings = json.load(f)
                writer.add_value(name, strings[leaf.name])
                continue
            info = ocp_types.ParamInfo(
                name=leaf.name,
                parent_dir=epath.Path(pdir),
                is_ocdbt_checkpoint=use_ocdbt,
                use_zarr3=use_zarr3,
                ts_context=ctx,
            )
            spec = ts_utils.build_array_read_spec(info, use_ocdbt=use_ocdbt).json
            t = ts.open(spec, open=True, read=True, context=ctx).result()
            dtype = np.dtype(t.dtype.numpy_dtype)
            shape = tuple(int(d) for d in t.shape)
            if isinstance(leaf, ocp.metadata.ScalarMetadata):
                writer.add_value(name, np.asarray(t.read().result()).item())
                continue
            origin = "numpy" if vtype == "np.ndarray" else "jax"
            if origin == "jax":
                kinds[name] = {"kind": "jax"}
            writer.add_array(name, dtype, shape, origin=origin)
            chunk = _shard_shape(shape, t.chunk_layout.read_chunk.shape) if shape else ()
            _copy_array(t, writer, name, shape, chunk, dtype.itemsize, block_bytes)
        return writer.commit(
            structure, {META_KEY: {"version": 1, "leaves": kinds}, "converted_from": "orbax"}
        )
    except BaseException:
        writer.abort()
        raise


def _shard_shape(shape: tuple[int, ...], chunk: Any, max_shards: int = 4096) -> tuple[int, ...]:
    """ckptio shards for an Orbax array: its chunks (= its saved shards), rows joined if very many."""
    c = [int(x) for x in (chunk or shape)]
    count = math.prod(-(-n // max(k, 1)) for n, k in zip(shape, c))
    if count > max_shards:
        c[0] = min(shape[0], c[0] * -(-count // max_shards))
    return tuple(c)


def _copy_array(
    t: Any,
    writer: StreamWriter,
    name: str,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    itemsize: int,
    block_bytes: int,
) -> None:
    """Read ``t`` block by block (a few reads in flight, about ``block_bytes`` in all) into shards."""
    inflight: list[tuple[tuple[int, ...], Any]] = []
    held = 0
    for offs, size in _boxes(shape, chunk, itemsize, block_bytes):
        inflight.append((offs, t[_index(offs, size)].read()))
        held += math.prod(size) * itemsize
        if held >= block_bytes:
            for o, fut in inflight:
                writer.write_shard(name, o, np.asarray(fut.result()))
            inflight, held = [], 0
    for o, fut in inflight:
        writer.write_shard(name, o, np.asarray(fut.result()))


# -- ckptio -> Orbax -------------------------------------------------------


def _grid(item: ArrayItem, block_bytes: int) -> tuple[int, ...]:
    """The chunk shape: the common grid of the saved shards (their gcd), rows cut to ``block_bytes``."""
    shape = list(shard_grid(item))
    if shape:
        row = math.prod(shape[1:]) * item.dtype.itemsize
        shape[0] = max(1, min(shape[0], block_bytes // max(row, 1)))
        if math.prod(-(-n // c) for n, c in zip(item.shape, shape)) > (1 << 16):  # far too many: rows only
            shape = [max(1, min(item.shape[0], block_bytes // max(row, 1) or 1))] + list(item.shape[1:])
    return tuple(shape)


@dataclasses.dataclass
class _Lazy:
    """An array leaf of the tree given to Orbax: read from ckptio only while Orbax's commit writes it."""

    store: CheckpointStore
    manifest: Manifest
    name: str
    item: ArrayItem
    chunk: tuple[int, ...]
    block_bytes: int
    progress: Progress | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.item.shape

    @property
    def dtype(self) -> np.dtype:
        return self.item.dtype

    @property
    def ndim(self) -> int:
        return len(self.item.shape)

    @property
    def size(self) -> int:
        return math.prod(self.item.shape)

    @property
    def nbytes(self) -> int:
        return self.item.nbytes

    async def write(self, info: Any, arg: Any) -> Any:
        import tensorstore as ts
        from orbax.checkpoint._src.serialization import ocdbt_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        spec = ts_utils.build_array_write_spec(
            info=info,
            arg=arg,
            global_shape=self.item.shape,
            local_shape=self.chunk,
            dtype=self.item.dtype,
            use_ocdbt=bool(info.is_ocdbt_checkpoint),
            process_index=ocdbt_utils.get_process_index_for_subdir(bool(info.is_ocdbt_checkpoint)),
        )
        t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
        pending: asyncio.Future[Any] | None = None
        for offs, size in _boxes(self.item.shape, self.chunk, self.item.dtype.itemsize, self.block_bytes):
            dest = np.empty(size, self.item.dtype)
            if dest.size:
                reqs = plan_region(
                    self.name, self.item, Region(offs, dest), self.manifest.objects, self.manifest.block_size
                )
                await asyncio.wrap_future(submit(self.store.engine.read(reqs)))
            if pending is not None:  # one block written while the next is read: two in memory
                await pending
            # ``dest`` is ours and never changed again: TensorStore may keep it instead of copying it.
            write = t[_index(offs, size)].write(dest, can_reference_source_data_indefinitely=True)
            pending = asyncio.ensure_future(write)
            if self.progress:
                self.progress("written", dest.nbytes)
        if pending is not None:
            await pending
        return spec.metadata


class _LazyJax(_Lazy):
    pass


class _LazyNumpy(_Lazy):
    pass


def _handler_class() -> type:
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint import future
    from orbax.checkpoint._src.metadata import array_metadata_store as array_metadata_store_lib
    from orbax.checkpoint._src.multihost import multihost

    class _StreamingHandler(ocp.type_handlers.ArrayHandler):
        """Writes :class:`_Lazy` leaves block by block, under the stock typestr (stock code restores them)."""

        def __init__(self, typestr: str) -> None:
            is_jax = typestr == ocp.type_handlers.ArrayHandler().typestr()
            super().__init__(
                array_metadata_store=array_metadata_store_lib.Store() if is_jax else None,
                enable_write_sharding_file=False,
            )
            self._typestr, self._is_jax = typestr, is_jax

        def typestr(self) -> str:
            return self._typestr

        async def serialize(self, values: Any, infos: Any, args: Any = None) -> list[Any]:
            args = args or [ocp.SaveArgs()] * len(values)

            async def write_all() -> None:
                metas = []
                for v, info, arg in zip(values, infos, args):
                    await info.await_path_creation()
                    metas.append(await v.write(info, arg))
                if self._array_metadata_store is not None and metas:
                    await self._array_metadata_store.write(
                        checkpoint_dir=infos[0].parent_dir,
                        array_metadatas=metas,
                        process_index=multihost.process_index(),
                    )
                if self._is_jax:
                    from orbax.checkpoint._src.serialization.jax_array_handlers import (
                        _async_serialize_shardings,
                    )

                    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                    await _async_serialize_shardings([one] * len(infos), infos, primary_host=0)

            return [future.CommitFutureAwaitingContractedSignals(write_all(), name="ckptio_convert")]

        async def deserialize(self, *a: Any, **k: Any) -> Any:
            raise NotImplementedError(
                "restore with Orbax's own handlers (the saved typestr is the stock one)"
            )

    return _StreamingHandler


def _registry() -> Any:
    import jax
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    handler = _handler_class()
    return th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (str, th.StringHandler()),
        (jax.Array, th.ArrayHandler()),
        (_LazyJax, handler(th.ArrayHandler().typestr())),
        (_LazyNumpy, handler(th.NumpyHandler().typestr())),
    )


def ckptio_to_orbax(
    src: CheckpointStore,
    step_dir: str,
    dst: str | os.PathLike[str],
    *,
    block_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> None:
    """Write the committed ckptio checkpoint ``src``/``step_dir`` as an Orbax PyTree directory ``dst``.

    ``ocp.StandardCheckpointer().restore(dst)`` reads it. Refuses an existing ``dst``.
    """
    import orbax.checkpoint as ocp
    from etils import epath

    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} already exists")
    manifest = run_sync(src.read_manifest(step_dir))
    meta = manifest.metadata.get(META_KEY, {}) if isinstance(manifest.metadata, dict) else {}
    kinds = meta.get("leaves", {}) if isinstance(meta, dict) else {}

    def leaf(name: str) -> Any:
        it = manifest.items[name]
        if isinstance(it, ValueItem):
            if isinstance(it.value, bytes):
                log.warning(
                    "%s: item %r is bytes, which Orbax cannot save; written as a uint8 array", src.url, name
                )
                return np.frombuffer(it.value, np.uint8).copy()
            return it.value
        if isinstance(it, HostStateItem):
            raise ValueError(f"{src.url}: item {name!r} is a per-host state (one per saving host): an Orbax PyTree "
                             "checkpoint has no place for it")
        if it.scalar:  # a numpy scalar: tiny, and Orbax saves it as a scalar
            dest = np.empty(it.shape, it.dtype)
            run_sync(
                src.engine.read(
                    plan_region(name, it, Region((), dest), manifest.objects, manifest.block_size)
                )
            )
            return dest[()]
        kind = kinds.get(name, {}).get("kind")
        if kind == "key":
            log.warning("%s: item %r is a PRNG key; written as its raw key data", src.url, name)
        cls = _LazyNumpy if it.origin == "numpy" and kind is None else _LazyJax
        return cls(src, manifest, name, it, _grid(it, block_bytes), block_bytes, progress)

    tree = unflatten(manifest.tree, leaf)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=False, type_handler_registry=_registry())
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(epath.Path(dst), args=ocp.args.PyTreeSave(tree))
