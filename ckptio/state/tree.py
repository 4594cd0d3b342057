"""Pytrees: flatten to ``(path, leaf)`` pairs and back.

A path is a tuple of dict keys (str) and sequence indices (int); its string
form (the item name in the manifest) joins them with ``/``, escaping ``%``
and ``/`` inside keys. The structure itself is saved as JSON (no pickle).

What is a node (everything else is a leaf):

* dicts (str keys), lists and tuples: kept as they are (a dict subclass, such
  as a torch ``state_dict``'s OrderedDict, saved as a dict; a target of one
  restores as one);
* NamedTuples (optax states such as ``ScaleByAdamState``): their fields;
* any node registered with ``jax.tree_util`` (flax ``struct.dataclass``,
  ``FrozenDict``, nnx ``State`` / ``Variable``, your own), when jax is
  imported: the children jax gives it, named by jax's keys (attribute names,
  dict keys, indices);
* typed PRNG keys (``jax.random.key(...)``): saved as their key data (a
  uint32 array under the key's own path) plus the name of their impl.

The saved structure is plain: a NamedTuple or a registered node is recorded
as a dict of its named children (attribute or field names, dict keys), or a
list when its children are positional. So a restore **without a target**
gives back dicts and lists in their place (and typed PRNG keys as typed keys);
a restore **with a target** rebuilds the target's own types (the target's
node carries its type and its static fields).
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["flatten", "flatten_named", "path_str", "tree_leaf_names", "tree_leaf_paths", "unflatten"]

Path = tuple[str | int, ...]

_MAX_DEPTH = 256

# A typed PRNG key's node: ``{"prng_key:<impl>": [<its key data's leaf>]}``. The impl rides in the
# kind and the body is a one-element list, so a reader that walks unknown kinds as sequences
# (older ckptio's item-name validation, the DCP converter) still finds the data leaf.
_KEY_KIND = "prng_key:"

# Leaves that are never pytree nodes: answered without asking jax.
_PLAIN_LEAVES = (np.ndarray, np.generic, str, bytes, int, float, complex, type(None))


class _Node(dict):  # type: ignore[type-arg]
    """A structure node of a live tree (a restore target): serialises as its plain JSON form,
    and rebuilds the target's own type from its children (in order)."""

    __slots__ = ("rebuild",)

    def __init__(self, plain: dict[str, Any], rebuild: Callable[[list[Any]], Any]) -> None:
        super().__init__(plain)
        self.rebuild = rebuild


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def path_str(path: Path) -> str:
    """``("params", "w", 0)`` -> ``"params/w/0"``; the root leaf is ``""``."""
    return "/".join(_escape(p) if isinstance(p, str) else str(p) for p in path)


def _where(name: str) -> str:
    return repr(name or "<root>")


def _jax() -> Any:
    # Frameworks are never imported here: a jax node can only exist once jax is imported.
    return sys.modules.get("jax")


def is_prng_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``), or an abstract one (ShapeDtypeStruct)."""
    jax = _jax()
    dtype = getattr(x, "dtype", None)
    if jax is None or dtype is None or isinstance(x, np.ndarray) or isinstance(dtype, np.dtype):
        return False  # a key's dtype is jax's own (extended) type, never a numpy dtype
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def prng_impl_name(x: Any) -> str:
    """The impl name (``"threefry2x32"``, ``"rbg"``, ...) of a typed key array or its abstract value."""
    jax = _jax()
    if isinstance(x, jax.Array):
        impl = jax.random.key_impl(x)
        return impl if isinstance(impl, str) else str(getattr(impl, "name", impl))
    return str(x.dtype._impl.name)  # an abstract key (ShapeDtypeStruct): only its dtype knows


def wrap_prng_key(data: Any, impl: str) -> Any:
    """Key data (uint32, trailing key dimensions) back into a typed key of ``impl``."""
    import jax  # only a checkpoint that holds a typed key gets here: it was saved by jax

    return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=impl)


def _node_children(node: Any, name: str) -> tuple[list[str | int], list[Any], Callable[[list[Any]], Any]] | None:
    """``(keys, children, rebuild)`` of a NamedTuple or a jax-registered node; None for a leaf."""
    if isinstance(node, tuple) and isinstance(getattr(type(node), "_fields", None), tuple):
        cls = type(node)
        return list(cls._fields), list(node), lambda children: cls(*children)
    jax = _jax()
    if jax is None or isinstance(node, jax.Array):
        return None
    # One level only: everything below the node is a "leaf" here, and walked by flatten.
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None  # jax sees a leaf
    keys: list[str | int] = []
    for key_path, _child in pairs:
        (key,) = key_path
        keys.append(_key_component(key, name))
    return keys, [c for _k, c in pairs], treedef.unflatten


def _key_component(key: Any, name: str) -> str | int:
    """A jax key entry as a path component: attribute and dict names as str, indices as int."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            value = getattr(key, attr)
            break
    else:
        value = str(key)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, int, np.integer)):
        raise TypeError(
            f"the pytree node at {_where(name)} has a child keyed {value!r} ({type(value).__name__}); "
            "ckptio names children by str keys and int indices"
        )
    return value if isinstance(value, str) else int(value)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple[Path, Any]], Any]:
    """Flatten ``tree`` into ``(path, leaf)`` pairs and a JSON-able structure.

    Nodes are dicts (str keys), lists, tuples, NamedTuples and jax-registered
    pytree nodes (see the module docstring); ``is_leaf`` may claim any node
    as a leaf. Raises TypeError naming the path of a bad key.
    """
    paths: list[Path] = []
    _names, values, structure = _flatten(tree, is_leaf, paths)
    return list(zip(paths, values)), structure


def flatten_named(tree: Any, is_leaf: Callable[[Any], bool] | None = None,
                  deferred: list[Callable[[], None]] | None = None) -> tuple[list[str], list[Any], Any]:
    """Like :func:`flatten`, with each leaf's item name (its :func:`path_str`) instead of its path.

    The names are built one component per node on the way down, not joined per leaf, and
    a wide dict of numpy arrays is named in bulk: a state of 100k leaves is named in one
    pass at well under a microsecond a leaf. With ``deferred``, the structure of such a
    dict (a small dict per leaf) is left to a call appended there, which the caller runs
    before using the structure: a save builds it off the training step's path. Only str
    keys and names are captured, so a tree changed after the call does not change it.
    """
    return _flatten(tree, is_leaf, None, deferred)


def _flatten(tree: Any, is_leaf: Callable[[Any], bool] | None, paths: list[Path] | None,
             deferred: list[Callable[[], None]] | None = None) -> tuple[list[str], list[Any], Any]:
    """Names, leaves and structure of ``tree``; each leaf's path appended to ``paths`` if given.

    A node's children are named ``prefix + component``, where ``prefix`` is the node's own name
    and a slash (nothing at the root), so a leaf costs one concatenation.
    """
    walker = _Flattener(is_leaf, paths, deferred)
    structure = walker.walk(tree, (), "", 0)
    return walker.names, walker.values, structure


class _Flattener:
    """One walk of :func:`_flatten`: the names and leaves found so far, and how to walk a node."""

    def __init__(self, is_leaf: Callable[[Any], bool] | None, paths: list[Path] | None,
                 deferred: list[Callable[[], None]] | None) -> None:
        self.names: list[str] = []
        self.values: list[Any] = []
        self.is_leaf, self.paths, self.deferred = is_leaf, paths, deferred
        self.fast = is_leaf is None and paths is None  # plain numpy leaves of a dict need no call
        self.jax = _jax()
        # jax arrays are leaves too (a typed PRNG key aside): answered before asking jax about nodes.
        self.plain = _PLAIN_LEAVES if self.jax is None else (*_PLAIN_LEAVES, self.jax.Array)

    def leaf(self, path: Path, name: str, node: Any) -> dict[str, str]:
        if self.paths is not None:
            self.paths.append(path)
        self.names.append(name)
        self.values.append(node)
        return {"leaf": name}

    def sub(self, path: Path, k: str | int) -> Path:
        return (*path, k) if self.paths is not None else path

    def walk(self, node: Any, path: Path, name: str, depth: int) -> Any:
        """The structure of ``node`` (named ``name``, at ``path``), its leaves recorded on the way."""
        if type(node) is np.ndarray and self.is_leaf is None:  # the commonest leaf, first
            return self.leaf(path, name, node)
        if depth > _MAX_DEPTH:
            raise ValueError(f"state is nested deeper than {_MAX_DEPTH} levels at {name!r}")
        if self.is_leaf is not None and self.is_leaf(node):
            return self.leaf(path, name, node)
        prefix = f"{name}/" if depth else ""
        if isinstance(node, dict):
            return self.walk_dict(node, path, name, depth, prefix)
        if type(node) in (list, tuple):
            return {type(node).__name__: [self.walk(v, self.sub(path, i), prefix + str(i), depth + 1)
                                          for i, v in enumerate(node)]}
        key = is_prng_key(node)  # cheap for arrays of numpy dtypes
        if not key and isinstance(node, self.plain):
            return self.leaf(path, name, node)
        if key:
            impl = prng_impl_name(node)
            return {_KEY_KIND + impl: [self.leaf(path, name, self.jax.random.key_data(node))]}
        found = _node_children(node, name)
        if found is None:
            return self.leaf(path, name, node)
        keys, children, rebuild = found
        if keys and all(isinstance(k, int) for k in keys):
            body = {"list": [self.walk(c, self.sub(path, k), prefix + _part(k), depth + 1)
                             for k, c in zip(keys, children)]}
        else:
            named = {str(k): (k, c) for k, c in zip(keys, children)}
            if len(named) != len(keys):
                raise TypeError(f"the pytree node at {_where(name)} has children with clashing names {keys!r}")
            body = {"dict": {n: self.walk(c, self.sub(path, k), prefix + _part(k), depth + 1)
                             for n, (k, c) in named.items()}}
        return _Node(body, rebuild)

    def walk_dict(self, node: dict[str, Any], path: Path, name: str, depth: int, prefix: str) -> Any:
        """The structure of a dict node: a wide dict of plain arrays named in bulk, else key by key."""
        if self.fast and len(node) > 8:
            wide = self.wide_dict(node, prefix)
            if wide is not None:
                return wide
        body: dict[str, Any] = {}
        names, values, ndarray = self.names, self.values, np.ndarray
        for k, v in node.items():
            if type(k) is not str and not isinstance(k, str):
                raise TypeError(
                    f"dict key {k!r} at {name or '<root>'!r} is a {type(k).__name__}; ckptio needs str keys"
                )
            if self.fast and type(v) is ndarray:
                n = prefix + (_escape(k) if "%" in k or "/" in k else k)
                names.append(n)
                values.append(v)
                body[k] = {"leaf": n}
            else:
                body[k] = self.walk(v, self.sub(path, k), prefix + _part(k), depth + 1)
        if type(node) is not dict:  # an OrderedDict (a torch state_dict), a defaultdict: rebuilt as one
            return _Node({"dict": body}, functools.partial(_rebuild_dict, _empty_like(node), list(body)))
        return {"dict": body}

    def wide_dict(self, node: dict[str, Any], prefix: str) -> Any:
        """A dict of only plain numpy arrays, named in bulk (its structure deferred when it may be);
        None if it is not one."""
        wide = _wide_array_dict(node, prefix)
        if wide is None:
            return None
        keys, wide_names, wide_values = wide
        self.names.extend(wide_names)
        self.values.extend(wide_values)
        out: dict[str, Any] = {"dict": None}
        build = functools.partial(_leaf_dict, out, keys, wide_names)
        if type(node) is not dict:  # a _Node copies its body: built now, not deferred
            build()
            return _Node(out, functools.partial(_rebuild_dict, _empty_like(node), keys))
        if self.deferred is None:
            build()
        else:
            self.deferred.append(build)
        return out


def _part(k: str | int) -> str:
    """A key as its name's component (escaped if it holds ``%`` or ``/``)."""
    if type(k) is str:
        return _escape(k) if "%" in k or "/" in k else k
    return str(k)


def _empty_like(node: dict[str, Any]) -> dict[str, Any] | None:
    """An empty dict of ``node``'s type (a defaultdict keeps its factory), holding none of its
    values: a structure must not keep a saved state alive. Made by the type's constructor, not
    by copying ``node`` (a copy of a 100k-entry OrderedDict costs 0.2 s). None for a type whose
    constructor wants arguments."""
    try:
        if isinstance(node, collections.defaultdict):
            return type(node)(node.default_factory)
        return type(node)()
    except Exception:  # any subclass's constructor may refuse: its data still comes back, as a plain dict
        return None


def _rebuild_dict(empty: dict[str, Any] | None, keys: list[str], children: list[Any]) -> dict[str, Any]:
    if empty is None:
        return dict(zip(keys, children))
    out = copy.copy(empty)  # a structure may rebuild more than once
    out.update(zip(keys, children))
    return out


def _wide_array_dict(node: dict[Any, Any], prefix: str) -> tuple[list[str], list[str], list[Any]] | None:
    """``(keys, names, values)`` of a dict whose keys need no escaping and whose values are all
    numpy arrays (a flat state of 100k arrays), named in bulk; None when it is anything else."""
    keys = list(node)
    try:
        joined = "".join(keys)  # also: every key a str
    except TypeError:
        return None
    if "/" in joined or "%" in joined:
        return None
    values = list(node.values())
    ndarray = np.ndarray
    for v in values:
        if type(v) is not ndarray:
            return None
    return keys, ([prefix + k for k in keys] if prefix else keys), values


def _leaf_dict(out: dict[str, Any], keys: list[str], names: list[str]) -> None:
    out["dict"] = {k: {"leaf": n} for k, n in zip(keys, names)}


def unflatten(structure: Any, leaf_for: Callable[[str], Any]) -> Any:
    """Rebuild the tree of ``structure``, asking ``leaf_for(path_str)`` for each leaf.

    A structure from a live tree (a restore target) rebuilds its own types; a
    saved one gives dicts and lists for NamedTuples and registered nodes.
    """
    if not isinstance(structure, dict) or len(structure) != 1:
        raise ValueError(f"malformed tree node {str(structure)[:80]!r}")
    (kind, body), = structure.items()
    if kind == "leaf" and isinstance(body, str):
        return leaf_for(body)
    rebuild = getattr(structure, "rebuild", None)
    if kind == "dict" and isinstance(body, dict):
        try:  # a dict of leaves only (a wide state's), in one comprehension
            out = {k: leaf_for(v["leaf"]) for k, v in body.items()}
        except (KeyError, TypeError, IndexError):  # a node among them (or a fault the full walk names)
            out = {k: _child(v, leaf_for) for k, v in body.items()}
        return out if rebuild is None else rebuild(list(out.values()))
    if kind in ("list", "tuple") and isinstance(body, list):
        seq = [_child(v, leaf_for) for v in body]
        if rebuild is not None:
            return rebuild(seq)
        return seq if kind == "list" else tuple(seq)
    if kind.startswith(_KEY_KIND) and isinstance(body, list) and len(body) == 1:
        return wrap_prng_key(unflatten(body[0], leaf_for), kind[len(_KEY_KIND):])
    raise ValueError(f"malformed tree node of kind {kind!r}")


def _child(node: Any, leaf_for: Callable[[str], Any]) -> Any:
    # A leaf answered here, without a call of unflatten per leaf (100k-leaf states).
    if type(node) is dict and len(node) == 1:
        name = node.get("leaf")
        if type(name) is str:
            return leaf_for(name)
    return unflatten(node, leaf_for)


def tree_leaf_names(structure: Any) -> list[str]:
    """Every leaf path string of a JSON structure, in no particular order (faster than
    :func:`tree_leaf_paths` on wide trees). Raises ValueError, TypeError or AttributeError
    on a malformed node, as it does: a node :func:`unflatten` could not rebuild included,
    so a manifest's tree is refused when it is read, not midway through a restore."""
    out: list[str] = []
    stack = [structure]
    while stack:
        (kind, body), = stack.pop().items()
        if kind == "leaf":
            if type(body) is not str:
                raise ValueError(f"a leaf's name must be a string, got {str(body)[:40]!r}")
            out.append(body)
            continue
        children = _children(kind, body)
        leaves = [c["leaf"] for c in children if type(c) is dict and len(c) == 1 and "leaf" in c]
        if len(leaves) == len(children):  # a node of leaves only (a wide state's), in one pass
            out += leaves
            continue
        for child in children:
            if type(child) is dict and len(child) == 1 and type(child.get("leaf")) is str:
                out.append(child["leaf"])
            else:
                stack.append(child)
    return out


def _children(kind: str, body: Any) -> list[Any]:
    """The child nodes of a structure node of ``kind``; ValueError for a kind or body unflatten refuses."""
    if kind == "dict" and isinstance(body, dict):
        return list(body.values())
    if isinstance(body, list) and (kind in ("list", "tuple")
                                   or (kind.startswith(_KEY_KIND) and len(body) == 1)):
        return body
    known = kind in ("dict", "list", "tuple") or kind.startswith(_KEY_KIND)
    raise ValueError(f"{'malformed tree node of kind' if known else 'unknown tree node kind'} {kind[:40]!r}")


def tree_leaf_paths(structure: Any) -> Iterator[str]:
    """Every leaf path string of a JSON structure, in order."""
    (kind, body), = structure.items()
    if kind == "leaf":
        yield body
    elif kind == "dict":
        for v in body.values():
            yield from tree_leaf_paths(v)
    else:
        for v in body:
            yield from tree_leaf_paths(v)
