"""JAX pytrees <-> ckptio items: naming by keypath, staging to host, restore targets.

Any jax pytree (dicts, lists, tuples, NamedTuples, flax/optax nodes, registered
dataclasses) is flattened with :mod:`jax.tree_util` keypaths; each leaf
becomes the ckptio item named by its path (``params/dense/kernel``,
``opt_state/0/mu/w``). The pytree's own classes are never saved (no pickle):
a restore takes its structure from the abstract target, or returns nested
dicts when there is none -- as Orbax does.

Staging runs on the caller's thread (the training step), because it is the
only moment the arrays are guaranteed alive: a jitted step may donate them
right after. jax shards are brought to host (``replica_id == 0`` only:
one replica of each shard is written); numpy arrays are copied (mutable);
everything else is an immutable value.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ckptio.errors import UnsupportedLeafError
from ckptio.manifest import ArrayItem, Manifest, encode_value
from ckptio.manifest.hoststate import HostStateItem
from ckptio.orbax._cast import cast_checked, jax_dtype
from ckptio.orbax._resize import Box, box_slices, covered, needs_resize, padded
from ckptio.saving.devicecopy import Snapshots
from ckptio.state.leaves import Sharded, index_to_box
from ckptio.state.perhost import PerHost, is_per_host_leaf, state_of
from ckptio.state.tree import path_str, tree_leaf_paths, unflatten

__all__ = [
    "META_KEY",
    "Leaf",
    "RestorePlan",
    "StagedTree",
    "check_tree",
    "jax_target",
    "key_parts",
    "numpy_target",
    "plan_restore",
    "stage_tree",
]

#: The manifest's user-metadata key under which the adapter records what it needs to rebuild leaves.
META_KEY = "ckptio.orbax"

Parts = tuple[str, ...]
#: Turns what ckptio restored for a leaf into the leaf the caller gets.
Finish = Callable[[Any], Any]


def key_parts(path: Sequence[Any]) -> Parts:
    """A jax keypath as string components: dict keys, sequence indices, attribute names."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(str(k.key))
        else:  # a custom key class: its str is what the user would recognise
            out.append(str(k))
    return tuple(out)


@dataclasses.dataclass
class Leaf:
    """One flattened leaf: its path components, item name and value."""

    parts: Parts
    name: str
    value: Any


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Leaf], Any]:
    """Leaves with their item names, and the treedef. Two leaves may not share a name."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    leaves = []
    seen: dict[str, Parts] = {}
    for path, value in pairs:
        parts = key_parts(path)
        name = path_str(parts)
        if name in seen:
            raise ValueError(
                f"two leaves of the state map to the item name {name!r} ({jax.tree_util.keystr(path)}): "
                "their keys differ only in type (e.g. 1 and '1'); rename one"
            )
        seen[name] = parts
        leaves.append(Leaf(parts, name, value))
    return leaves, treedef


def nest(leaves: Sequence[Leaf], values: Sequence[Any]) -> Any:
    """Nested dicts keyed by path components (the form ckptio saves and Restore(None) returns)."""
    if len(leaves) == 1 and not leaves[0].parts:
        return values[0]  # the state is a single leaf
    root: dict[str, Any] = {}
    for leaf, value in zip(leaves, values):
        node = root
        for i, part in enumerate(leaf.parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"item {path_str(leaf.parts[: i + 1])!r} is both a leaf and a subtree")
            node = nxt
        if leaf.parts[-1] in node:
            raise ValueError(f"item {leaf.name!r} is both a leaf and a subtree")
        node[leaf.parts[-1]] = value
    return root


# -- saving --------------------------------------------------------------


@dataclasses.dataclass
class StagedTree:
    """A state staged for ckptio: the tree to save (nested dicts of host data) and adapter metadata."""

    tree: Any
    meta: dict[str, Any]
    nbytes: int


def _is_key_array(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _check_leaf(where: str, v: Any) -> None:
    if isinstance(v, jax.Array) or v is None or is_per_host_leaf(v):
        return
    if isinstance(v, (np.ndarray, np.generic)):
        if v.dtype.hasobject:
            raise UnsupportedLeafError(
                f"{where}: dtype {v.dtype} holds Python objects, which ckptio does not pickle"
            )
        return
    try:
        encode_value(v, where)
    except TypeError:
        raise UnsupportedLeafError(
            f"{where}: cannot save a leaf of type {type(v).__module__}.{type(v).__qualname__}; "
            "ckptio.orbax saves jax and numpy arrays, numpy scalars, int, float, bool, str, bytes "
            "and None -- never pickle"
        ) from None


def check_tree(state: Any) -> None:
    """Raise if ``state`` cannot be saved (a leaf type, clashing names), without touching its data.

    Run when the Save args are built: a handler that fails inside Orbax's
    ``async_save`` leaves Orbax's directory-creation signals pending, and the
    manager then waits for them until its timeout.
    """
    leaves, _ = flatten(state)
    for leaf in leaves:
        _check_leaf(leaf.name or "<root>", leaf.value)


def stage_tree(state: Any, device_snapshot: str = "auto") -> StagedTree:
    """Stage every leaf of ``state`` on the calling thread (see the module docstring).

    A jax array's shards are snapshot as a native save's are (``ckptio.saving.devicecopy``): a copy
    on its own device where memory allows, whose bytes cross to the host behind the step, in the
    save's write; else a host copy now."""
    leaves, _ = flatten(state)
    for leaf in leaves:
        _check_leaf(leaf.name or "<root>", leaf.value)
    kinds: dict[str, Any] = {}
    snapshots = Snapshots(device_snapshot)
    staged: list[Any] = []
    nbytes = 0
    for leaf in leaves:
        v = leaf.value
        if isinstance(v, jax.Array):
            kind: dict[str, Any] = {"kind": "jax"}
            if _is_key_array(v):
                # Typed PRNG keys have no numpy dtype: save their raw data and the impl's name.
                kind = {"kind": "key", "impl": str(jax.random.key_impl(v))}
                v = jax.random.key_data(v)
            pieces: list[Any] = []
            for s in v.addressable_shards:
                if s.replica_id == 0:
                    pieces.append((s.index, snapshots.take(s.data)))
                    nbytes += s.data.nbytes
            staged.append(Sharded(tuple(v.shape), np.dtype(v.dtype), pieces))
            kinds[leaf.name] = kind
        elif isinstance(v, np.ndarray):
            staged.append(np.array(v, copy=True, order="C"))  # mutable: the step may change it next
            nbytes += v.nbytes
        elif is_per_host_leaf(v):  # a data iterator: its state now, as Orbax saves grain's per process
            staged.append(PerHost(copy.deepcopy(state_of(v))))
        else:  # numpy scalars and values: immutable
            staged.append(v)
    snapshots.settle()
    meta = {"version": 1, "leaves": kinds}
    return StagedTree(nest(leaves, staged) if leaves else {}, meta, nbytes)


# -- restoring -----------------------------------------------------------


def _is_target_leaf(x: Any) -> bool:
    return isinstance(x, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))


@dataclasses.dataclass
class RestorePlan:
    """What to ask ckptio for (``target``), and how to turn its answer into the caller's tree."""

    target: Any
    finish: Callable[[Any], Any]


def _identity(x: Any) -> Any:
    return x


def numpy_target(
    name: str, item: ArrayItem, shape: Sequence[int], dtype: Any, strict: bool = True
) -> tuple[Any, Finish]:
    """A numpy leaf of ``dtype`` and ``shape`` (cast on the host, checked, when not the saved dtype;
    padded or truncated, when not the saved shape and ``strict`` is False)."""
    resize = needs_resize(name, item, shape, strict)
    if np.dtype(dtype) == item.dtype and not resize:
        # A fresh buffer: the abstract tree is a description, not storage to overwrite.
        return np.empty(item.shape, item.dtype), _identity
    target, fill = _host_resized(item, shape) if resize else (None, _identity)

    def finish(host: Any) -> Any:
        out = cast_checked(name, fill(host), dtype, asked=True)
        return out[()] if isinstance(host, np.generic) else out  # a saved numpy scalar stays one

    return target, finish


def _host_resized(item: ArrayItem, shape: Sequence[int]) -> tuple[Any, Finish]:
    """Read the part of the saved array that a whole array of ``shape`` covers; pad it to ``shape``."""
    box = covered(((0,) * len(item.shape), tuple(shape)), item.shape)
    if box is None:  # nothing in common (a zero-size dimension): all padding, nothing read
        return Sharded(item.shape, item.dtype, []), lambda _: padded(shape, item.dtype, None)
    target = Sharded(item.shape, item.dtype, [(box_slices(box), None)])
    return target, lambda got: padded(shape, item.dtype, got.pieces[0][1])


def jax_target(
    name: str, item: ArrayItem, shape: Sequence[int], dtype: Any, sharding: Any, strict: bool = True
) -> tuple[Any, Finish]:
    """A jax leaf asked for as ``dtype`` and ``shape`` on ``sharding`` (None: the default device).

    When jax cannot hold the saved dtype as asked (``dtype`` differs, or
    jax_enable_x64 is off for a 64-bit item), the addressable slices are read
    to host buffers in the saved dtype, cast there with a check of every
    value (:func:`cast_checked`), and only then put on the devices. A
    ``shape`` other than the saved one (``strict=False`` only) reads the part
    of each slice the saved array covers, zero-padded (:mod:`._resize`).
    """
    resize = needs_resize(name, item, shape, strict)
    shape = tuple(int(d) for d in shape)
    final = jax_dtype(dtype)
    if final == item.dtype and not resize:
        return jax.ShapeDtypeStruct(item.shape, item.dtype, sharding=sharding), _identity
    asked = np.dtype(dtype) != item.dtype  # else jax forces the change, and it must lose nothing
    if sharding is None:
        target, fill = _host_resized(item, shape) if resize else (None, _identity)
        return target, lambda host: jax.numpy.asarray(cast_checked(name, fill(host), final, asked=asked))
    per_device = []
    reads: dict[Box, Any] = {}  # saved-array boxes to read, one per distinct target slice (replicas: once)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        box = index_to_box(index, shape)
        part = covered(box, item.shape)
        if part is not None:
            reads.setdefault(part, box_slices(part))
        per_device.append((device, box, part))
    target = Sharded(item.shape, item.dtype, [(index, None) for index in reads.values()])

    def finish(got: Sharded) -> Any:
        host = {index_to_box(i, item.shape): p for i, p in got.pieces}
        cast: dict[Box, np.ndarray] = {}
        arrays = []
        for device, box, part in per_device:
            if box not in cast:
                values = host[part] if part is not None else None
                if part is None or part != box:  # the far end lies beyond the saved array: zeros there
                    values = padded(box[1], item.dtype, values)
                cast[box] = cast_checked(name, values, final, asked=asked)
            arrays.append(jax.device_put(cast[box], device))
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)

    return target, finish


def _from_metadata(abstract: Any) -> Any:
    """An Orbax ``ArrayMetadata`` leaf (from ``metadata()``, as Orbax accepts it for a target) as the
    ``jax.ShapeDtypeStruct`` it describes; anything else unchanged."""
    try:
        from orbax.checkpoint._src.metadata import value as value_metadata
    except ImportError:  # pragma: no cover - a later Orbax moved it; such targets then restore as saved
        return abstract
    if not isinstance(abstract, value_metadata.ArrayMetadata) or abstract.dtype is None:
        return abstract
    sharding = abstract.sharding.to_jax_sharding() if abstract.sharding is not None else None
    return jax.ShapeDtypeStruct(tuple(abstract.shape), abstract.dtype, sharding=sharding)


def _leaf_target(
    name: str, abstract: Any, item: Any, kind: dict[str, Any], strict: bool = True
) -> tuple[Any, Finish]:
    """The ckptio target for one leaf and the post-processing of what comes back.

    A restore never changes a dtype the caller did not ask to change: numpy
    leaves asked for without a sharding come back as numpy (as Orbax returns
    them), and casts to jax go through :func:`jax_target`'s checks. A shape
    other than the saved one raises unless ``strict`` is False (then: padded
    or truncated, as Orbax does).
    """
    abstract = _from_metadata(abstract)
    if isinstance(item, HostStateItem):  # this host's own state, loaded into a stateful target in place
        return (abstract if is_per_host_leaf(abstract) else None), _identity
    if not isinstance(item, ArrayItem):
        return None, _identity  # a value: as saved
    if kind.get("kind") == "key":
        impl = str(kind.get("impl", ""))
        sharding = getattr(abstract, "sharding", None)
        # The target may describe the keys (key dtype) or their data (uint32, from the TypeHandler).
        key_target = _is_target_leaf(abstract) and _is_key_array(abstract)
        if key_target and tuple(abstract.shape) != item.shape[: len(abstract.shape)]:
            raise ValueError(f"item {name!r}: target shape {abstract.shape} but saved keys {item.shape}")
        tgt = jax.ShapeDtypeStruct(item.shape, item.dtype, sharding=sharding)
        return tgt, lambda data: jax.random.wrap_key_data(data, impl=impl)
    if isinstance(abstract, np.ndarray):
        return numpy_target(name, item, abstract.shape, abstract.dtype, strict)
    if isinstance(abstract, (jax.ShapeDtypeStruct, jax.Array)):
        sharding = getattr(abstract, "sharding", None)
        if sharding is None and kind.get("kind") != "jax":
            # A numpy leaf and no sharding: numpy, as Orbax returns it (jax could narrow 64-bit types).
            return numpy_target(name, item, abstract.shape, abstract.dtype, strict)
        return jax_target(name, item, abstract.shape, abstract.dtype, sharding, strict)
    if abstract is None and kind.get("kind") == "jax":
        # No target: a jax leaf comes back as a jax array on the default device.
        return jax_target(name, item, item.shape, item.dtype, None)
    return None, _identity  # numpy arrays and values: as saved


def plan_restore(manifest: Manifest, abstract: Any, strict: bool | Mapping[str, bool] = True) -> RestorePlan:
    """The ckptio target tree for ``abstract`` (any pytree, or None for "everything as saved").

    ``strict``: False lets array leaves whose target shape differs from the
    saved one (same rank) be padded with zeros or truncated, as Orbax's
    ``strict=False``; a mapping gives it per item name (default True).
    """
    if isinstance(strict, bool):
        strict_of: Callable[[str], bool] = lambda _name, s=strict: s  # noqa: E731
    else:
        strict_of = lambda name, m=strict: bool(m.get(name, True))  # noqa: E731
    meta = manifest.metadata.get(META_KEY, {}) if isinstance(manifest.metadata, dict) else {}
    kinds = meta.get("leaves", {}) if isinstance(meta, dict) else {}
    if abstract is None:
        # Everything as saved, in the saved structure (nested dicts).
        order = list(tree_leaf_paths(manifest.tree))
        plans = {n: _leaf_target(n, None, manifest.items[n], kinds.get(n, {})) for n in order}
        target = unflatten(manifest.tree, lambda n: plans[n][0])

        def finish_all(restored: Any) -> Any:
            flat = dict(zip(order, _leaves_in_order(restored, manifest.tree)))
            return unflatten(manifest.tree, lambda n: plans[n][1](flat[n]))

        return RestorePlan(target, finish_all)
    # None is an empty subtree for jax (as when saving): it comes back as None, never read.
    leaves, treedef = flatten(abstract)
    missing = [lf.name for lf in leaves if lf.name not in manifest.items]
    if missing:
        raise KeyError(
            f"the abstract state asks for {missing[:5]} which the checkpoint does not hold "
            f"(it holds {sorted(manifest.items)[:10]}{'...' if len(manifest.items) > 10 else ''})"
        )
    pairs = [
        _leaf_target(lf.name, lf.value, manifest.items[lf.name], kinds.get(lf.name, {}), strict_of(lf.name))
        for lf in leaves
    ]

    def finish(restored: Any) -> Any:
        flat = _flat_by_parts(restored, leaves)
        return jax.tree_util.tree_unflatten(treedef, [f(x) for (_, f), x in zip(pairs, flat)])

    return RestorePlan(nest(leaves, [t for t, _ in pairs]) if leaves else {}, finish)


def _flat_by_parts(tree: Any, leaves: Sequence[Leaf]) -> list[Any]:
    out = []
    for leaf in leaves:
        node = tree
        for part in leaf.parts:
            node = node[part]
        out.append(node)
    return out


def _leaves_in_order(tree: Any, structure: Any) -> list[Any]:
    """Leaves of a restored ckptio tree in the order of ``structure`` (dict/list/tuple nodes)."""
    ((kind, body),) = structure.items()
    if kind == "leaf":
        return [tree]
    if kind == "dict":
        return [x for k, v in body.items() for x in _leaves_in_order(tree[k], v)]
    return [x for i, v in enumerate(body) for x in _leaves_in_order(tree[i], v)]
