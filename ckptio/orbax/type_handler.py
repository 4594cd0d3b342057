"""A ``jax.Array`` TypeHandler, so Orbax's own handlers (``StandardSave``, ``PyTreeSave``) use ckptio.

>>> ckptio.orbax.register()          # once, before saving
>>> mngr.save(step, args=ocp.args.StandardSave(state))

Orbax keeps its tree metadata (``_METADATA``, with this handler's distinct
typestr, so a restore finds it again) and its numpy/scalar leaves; the
``jax.Array`` leaves of one save become one ckptio checkpoint in
``<item dir>/ckptio/<n>/`` -- inside the item directory, so Orbax's atomic
step commit and its retention cover every byte. Checkpoints written by
Orbax's own ``ArrayHandler`` (typestr ``jax.Array``) still restore through
it: :func:`register` keeps it as the fallback.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers as types

from ckptio.engine import EngineConfig, run_sync
from ckptio.engine.layout import Naming
from ckptio.manifest import ArrayItem, Manifest
from ckptio.orbax._cast import cast_staged, x64_context, x64_enabled
from ckptio.orbax._io import Location, StorageConfig, coordinator_for, url_of, write_and_commit
from ckptio.orbax._marker import write_marker
from ckptio.orbax._metadata import leaf_metadata
from ckptio.orbax._tree import META_KEY, plan_restore, stage_tree
from ckptio.restoring import restore_checkpoint
from ckptio.saving.options import SaveOptions
from ckptio.store import CheckpointStore

__all__ = ["TYPESTR", "CkptioArrayHandler", "CkptioNumpyHandler", "register", "unregister"]

#: Recorded in Orbax's tree metadata for leaves this handler wrote.
TYPESTR = "ckptio.jax.Array"
#: The ckptio store of an item, inside Orbax's item directory.
SUBDIR = "ckptio"


def _sharding_metadata() -> Any:
    try:
        from orbax.checkpoint._src.metadata import sharding as sm

        return sm
    except ImportError:  # pragma: no cover - a later Orbax moved it; restores then need explicit shardings
        return None


def _group_step(names: Sequence[str]) -> int:
    """A stable checkpoint number for one serialize call's set of leaves (usually the only one)."""
    h = hashlib.blake2b("\0".join(sorted(names)).encode(), digest_size=3)
    return int.from_bytes(h.digest(), "big")


class CkptioArrayHandler(types.TypeHandler):
    """Serializes ``jax.Array`` leaves through ckptio (one replica of each shard, each host its own)."""

    def __init__(
        self,
        *,
        naming: Naming | None = None,
        engine_config: EngineConfig | None = None,
        backend_options: dict[str, Any] | None = None,
        save_options: SaveOptions | None = None,
    ) -> None:
        self._config = StorageConfig(None, naming, engine_config, backend_options, save_options=save_options)
        #: Orbax's handler, for checkpoints it wrote (set by :func:`register`).
        self.fallback: types.TypeHandler | None = None

    def typestr(self) -> str:
        return TYPESTR

    # -- save ------------------------------------------------------------

    async def serialize(
        self,
        values: Sequence[jax.Array],
        infos: Sequence[types.ParamInfo],
        args: Sequence[types.SaveArgs] | None = None,
    ) -> Sequence[ocp.future.Future]:
        """Stage now (device -> host); the returned commit future writes and commits."""
        args = args or [types.SaveArgs()] * len(values)
        leaves = {}
        shardings: dict[str, str] = {}
        sm = _sharding_metadata()
        casts: dict[str, Any] = {}
        for value, info, arg in zip(values, infos, args):
            is_key = jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)  # keys cast as nothing
            if arg is not None and arg.dtype is not None and value.dtype != arg.dtype and not is_key:
                casts[info.name] = arg.dtype  # SaveArgs.dtype: Orbax casts before saving, so do we
            leaves[info.name] = value
            if sm is not None:
                meta = sm.from_jax_sharding(value.sharding)
                if meta is not None:  # lets a restore without a target use the saved sharding
                    shardings[info.name] = meta.to_serialized_string()
        staged = stage_tree(leaves, self._config.device_snapshot)
        for name, dtype in casts.items():
            # On the staged host copies: a jitted astype would run on the devices (and fails
            # on arrays committed to different devices).
            staged.tree[name] = cast_staged(_item_name(name), staged.tree[name], dtype)
        parent = infos[0].parent_dir
        step = _group_step(list(leaves))
        loc = Location(f"{url_of(parent)}/{SUBDIR}", step)
        coord = coordinator_for(parent, f"arrays:{step}")
        metadata = {META_KEY: {**staged.meta, "shardings": shardings}}
        config = self._config
        names = [info.name for info in infos]
        use_ocdbt, use_zarr3 = bool(infos[0].is_ocdbt_checkpoint), bool(infos[0].use_zarr3)

        async def commit() -> None:
            path = parent
            if hasattr(parent, "await_creation"):  # a PathAwaitingCreation
                path = await parent.await_creation()
            write_and_commit(parent, staged.tree, metadata, config, coord, loc)
            # So that a process without register() is told to call it (issue 16), not NOT_FOUND.
            write_marker(path, names, use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="ckptio_array_save")]

    # -- restore ---------------------------------------------------------

    def _manifests(self, parent: Any) -> tuple[CheckpointStore, dict[str, tuple[int, Manifest]]] | None:
        """Every ckptio checkpoint of the item (name -> (step, manifest)); None if it has none."""
        store = self._config.store(f"{url_of(parent)}/{SUBDIR}")
        try:
            steps = run_sync(store.committed_steps())
            if not steps:
                run_sync(store.close())
                return None
            by_name: dict[str, tuple[int, Manifest]] = {}
            for s in steps:
                m = run_sync(store.read_manifest(str(s)))
                for name in m.items:
                    by_name[name] = (s, m)
            return store, by_name
        except BaseException:
            run_sync(store.close())
            raise

    async def _await_paths(self, infos: Sequence[types.ParamInfo]) -> Any:
        await asyncio.gather(*[info.await_path_creation() for info in infos])
        return infos[0].parent_dir

    async def metadata(self, infos: Sequence[types.ParamInfo]) -> Sequence[Any]:
        parent = await self._await_paths(infos)
        found = await asyncio.to_thread(self._manifests, parent)
        if found is None:
            if self.fallback is not None:
                return await self.fallback.metadata(infos)
            raise FileNotFoundError(f"{url_of(parent)}: no ckptio arrays")
        store, by_name = found
        run_sync(store.close())
        sm = _sharding_metadata()
        out = []
        for info in infos:
            key = _item_name(info.name)
            _, m = by_name[key]
            item = m.items[key]
            assert isinstance(item, ArrayItem)
            serialized = m.metadata.get(META_KEY, {}).get("shardings", {}).get(key)
            sharding = sm.from_serialized_string(serialized) if sm is not None and serialized else None
            # With storage metadata (write_shape), as Orbax's ArrayHandler reports it.
            out.append(leaf_metadata(info.name, item, parent, sharding))
        return out

    async def deserialize(
        self, infos: Sequence[types.ParamInfo], args: Sequence[types.RestoreArgs] | None = None
    ) -> Sequence[jax.Array]:
        """Read only this host's addressable slices of each target sharding."""
        args = args or [types.ArrayRestoreArgs()] * len(infos)
        parent = await self._await_paths(infos)
        found = await asyncio.to_thread(self._manifests, parent)
        if found is None:
            if self.fallback is not None:  # written by Orbax's own handler
                return await self.fallback.deserialize(infos, args)
            raise FileNotFoundError(f"{url_of(parent)}: no ckptio arrays")
        store, by_name = found
        x64 = x64_enabled()  # the caller's, read on its thread: a jax.enable_x64 context does not reach ours

        def restore() -> list[jax.Array]:
            with x64_context(x64):
                return self._restore(store, by_name, infos, args)

        try:
            return await asyncio.to_thread(restore)
        finally:
            run_sync(store.close())

    def _restore(
        self,
        store: CheckpointStore,
        by_name: dict[str, tuple[int, Manifest]],
        infos: Sequence[types.ParamInfo],
        args: Sequence[types.RestoreArgs],
        as_numpy: bool = False,
    ) -> list[Any]:
        """Restore ``infos`` from ckptio's checkpoints, as jax arrays (or numpy arrays: ``as_numpy``)."""
        groups: dict[int, list[int]] = {}
        for i, info in enumerate(infos):
            key = _item_name(info.name)
            if key not in by_name:
                raise KeyError(f"{url_of(infos[0].parent_dir)}: ckptio holds no array {info.name!r}")
            groups.setdefault(by_name[key][0], []).append(i)
        out: list[Any] = [None] * len(infos)
        for step, idx in groups.items():
            manifest = by_name[_item_name(infos[idx[0]].name)][1]
            abstract = {infos[i].name: self._abstract(manifest, infos[i], args[i], as_numpy) for i in idx}
            # ArrayRestoreArgs.strict: False lets global_shape pad or truncate, as Orbax's deserialize.
            strict = {_item_name(infos[i].name): bool(getattr(args[i], "strict", True)) for i in idx}
            plan = plan_restore(manifest, abstract, strict)
            restored = plan.finish(restore_checkpoint(store, manifest, str(step), plan.target))
            for i in idx:
                out[i] = restored[infos[i].name]  # RestoreArgs.dtype: cast by the plan, on the host
        return out

    def _abstract(
        self, manifest: Manifest, info: types.ParamInfo, arg: types.RestoreArgs, as_numpy: bool = False
    ) -> Any:
        key = _item_name(info.name)
        item = manifest.items[key]
        assert isinstance(item, ArrayItem)
        shape = getattr(arg, "global_shape", None) or getattr(arg, "shape", None)
        if shape is None or manifest.metadata.get(META_KEY, {}).get("leaves", {}).get(key, {}).get("kind") == "key":
            shape = item.shape  # keys: the target describes the keys, the item holds their data
        # A shape other than the saved one: plan_restore pads/truncates under strict=False, else raises.
        dtype = getattr(arg, "dtype", None) or item.dtype  # RestoreArgs.dtype asks for a cast
        if as_numpy:  # only describes the wanted array (zero strides): plan_restore reads into a fresh one
            return np.broadcast_to(np.zeros((), dtype), tuple(shape))
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=self._sharding(manifest, key, info, arg))

    def _sharding(self, manifest: Manifest, key: str, info: types.ParamInfo, arg: types.RestoreArgs) -> Any:
        mesh, axes = getattr(arg, "mesh", None), getattr(arg, "mesh_axes", None)
        if mesh is not None and axes is not None:
            return jax.sharding.NamedSharding(mesh, axes)
        sharding = getattr(arg, "sharding", None)
        sm = _sharding_metadata()
        if sharding is not None:
            if sm is not None and isinstance(sharding, sm.ShardingMetadata):
                return sharding.to_jax_sharding()
            return getattr(sharding, "sharding", sharding)  # a jax Format carries its sharding
        serialized = manifest.metadata.get(META_KEY, {}).get("shardings", {}).get(key)
        if serialized and sm is not None:
            # As Orbax does without a target: the saved sharding (unsafe on another topology).
            try:
                return sm.from_serialized_string(serialized).to_jax_sharding()
            except Exception as e:  # e.g. saved on devices this process does not have
                raise ValueError(
                    f"{info.name}: the saved sharding does not fit here ({e}); pass a target"
                ) from e
        raise ValueError(
            f"{info.name}: no sharding to restore onto; pass one (e.g. a ShapeDtypeStruct with sharding)"
        )


class CkptioNumpyHandler(types.TypeHandler):
    """Orbax's ``np.ndarray`` handler, which also restores ckptio's arrays as numpy.

    A leaf that :class:`CkptioArrayHandler` wrote, asked for as numpy (an
    ``np.ndarray`` target, ``RestoreArgs(restore_type=np.ndarray)``), is read
    by ckptio: Orbax's handler would look for TensorStore data that is not
    there. Everything else -- saving numpy leaves, their metadata, restoring
    them -- is Orbax's handler's (``wrapped``), unchanged.
    """

    def __init__(self, wrapped: types.TypeHandler, arrays: CkptioArrayHandler) -> None:
        self.wrapped = wrapped
        self._arrays = arrays

    def typestr(self) -> str:
        return self.wrapped.typestr()

    async def metadata(self, infos: Sequence[types.ParamInfo]) -> Sequence[Any]:
        return await self.wrapped.metadata(infos)

    async def serialize(
        self,
        values: Sequence[Any],
        infos: Sequence[types.ParamInfo],
        args: Sequence[types.SaveArgs] | None = None,
    ) -> Sequence[ocp.future.Future]:
        return await self.wrapped.serialize(values, infos, args)

    async def deserialize(
        self, infos: Sequence[types.ParamInfo], args: Sequence[types.RestoreArgs] | None = None
    ) -> Sequence[Any]:
        args = args or [types.RestoreArgs()] * len(infos)
        parent = await self._arrays._await_paths(infos)
        found = await asyncio.to_thread(self._arrays._manifests, parent)
        if found is None:
            return await self.wrapped.deserialize(infos, args)
        store, by_name = found
        try:
            ours = [i for i, info in enumerate(infos) if _item_name(info.name) in by_name]
            theirs = [i for i in range(len(infos)) if i not in set(ours)]
            out: list[Any] = [None] * len(infos)
            if theirs:
                got = await self.wrapped.deserialize([infos[i] for i in theirs], [args[i] for i in theirs])
                for i, x in zip(theirs, got):
                    out[i] = x
            if ours:
                got = await asyncio.to_thread(
                    self._arrays._restore,
                    store,
                    by_name,
                    [infos[i] for i in ours],
                    [args[i] for i in ours],
                    True,
                )
                for i, x in zip(ours, got):
                    out[i] = x
            return out
        finally:
            run_sync(store.close())

    def __getattr__(self, name: str) -> Any:
        # Optional TypeHandler hooks of the wrapped handler (memory_size, finalize...).
        if name.startswith("__") or name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)


def _item_name(name: str) -> str:
    """The ckptio item of an Orbax leaf name (a dict key at the root of the staged tree)."""
    from ckptio.state.tree import path_str

    return path_str((name,))


class _NotRegistered(types.TypeHandler):
    """Answers Orbax's lookups of :data:`TYPESTR` until :func:`register` replaces it: "call register()".

    A restore without a target finds each leaf's handler by the typestr
    recorded in ``_METADATA``; without this, Orbax says only
    ``Unknown type: "ckptio.jax.Array"``. (A restore with a target uses
    Orbax's own ``jax.Array`` handler, which the on-disk marker of
    :mod:`ckptio.orbax._marker` answers instead.)
    """

    def typestr(self) -> str:
        return TYPESTR

    def _refuse(self) -> Any:
        from ckptio.orbax._marker import MARKER_MESSAGE

        raise ValueError(MARKER_MESSAGE)

    async def metadata(self, infos: Sequence[types.ParamInfo]) -> Sequence[Any]:
        return self._refuse()

    async def serialize(self, values: Any, infos: Any, args: Any = None) -> Any:
        return self._refuse()

    async def deserialize(self, infos: Any, args: Any = None) -> Any:
        return self._refuse()


class _Unmatched:
    """A type nothing is: the key under which :class:`_NotRegistered` joins Orbax's registry."""


def _install_not_registered() -> None:
    """Map :data:`TYPESTR` to :class:`_NotRegistered` unless a handler already answers it."""
    from orbax.checkpoint._src.serialization import type_handler_registry as registry

    if not registry.GLOBAL_TYPE_HANDLER_REGISTRY.has(TYPESTR):
        # func never matches a value's type: only typestr lookups (restores) reach it.
        types.register_type_handler(_Unmatched, _NotRegistered(), func=lambda ty: False)


def _override(ty: type, handler: Any) -> None:
    """``types.register_type_handler(ty, handler, override=True)`` without Orbax's warning: replacing
    its handler is what :func:`register` is for, and absl printed two warnings at every call."""
    from orbax.checkpoint._src.serialization import type_handler_registry as registry

    try:
        registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(ty, handler, None, True, ignore_warnings=True)
    except (AttributeError, TypeError):  # an Orbax without the flag: its warning it is
        types.register_type_handler(ty, handler, override=True)


def register(handler: CkptioArrayHandler | None = None) -> CkptioArrayHandler:
    """Route every ``jax.Array`` leaf of Orbax's pytree handlers through ckptio; returns the handler."""
    h = handler or CkptioArrayHandler()
    prev = types.get_type_handler(jax.Array)
    if not isinstance(prev, CkptioArrayHandler):
        h.fallback = prev
    elif h.fallback is None:
        h.fallback = prev.fallback
    _override(jax.Array, h)
    prev_np = types.get_type_handler(np.ndarray)
    if isinstance(prev_np, CkptioNumpyHandler):
        prev_np = prev_np.wrapped
    _override(np.ndarray, CkptioNumpyHandler(prev_np, h))
    return h


def unregister() -> None:
    """Give ``jax.Array`` back to the handler that had it before :func:`register`."""
    cur = types.get_type_handler(jax.Array)
    if isinstance(cur, CkptioArrayHandler) and cur.fallback is not None:
        _override(jax.Array, cur.fallback)
    cur_np = types.get_type_handler(np.ndarray)
    if isinstance(cur_np, CkptioNumpyHandler):
        _override(np.ndarray, cur_np.wrapped)


_install_not_registered()
