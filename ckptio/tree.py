"""Pytrees of dicts, lists and tuples: flatten to ``(path, leaf)`` pairs and back.

A path is a tuple of dict keys (str) and sequence indices (int); its string
form (the item name in the manifest) joins them with ``/``, escaping ``%``
and ``/`` inside keys. The structure itself is saved as JSON (no pickle).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["flatten", "path_str", "tree_leaf_paths", "unflatten"]

Path = tuple[str | int, ...]

_MAX_DEPTH = 256


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("/", "%2F")


def path_str(path: Path) -> str:
    """``("params", "w", 0)`` -> ``"params/w/0"``; the root leaf is ``""``."""
    return "/".join(_escape(p) if isinstance(p, str) else str(p) for p in path)


def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[tuple[Path, Any]], Any]:
    """Flatten ``tree`` into ``(path, leaf)`` pairs and a JSON-able structure.

    Dicts need str keys; any object that is not a dict, list or tuple (or that
    ``is_leaf`` claims) is a leaf. Raises TypeError naming the path of a bad key.
    """
    leaves: list[tuple[Path, Any]] = []

    def walk(node: Any, path: Path) -> Any:
        if len(path) > _MAX_DEPTH:
            raise ValueError(f"state is nested deeper than {_MAX_DEPTH} levels at {path_str(path)!r}")
        if is_leaf is not None and is_leaf(node):
            leaves.append((path, node))
            return {"leaf": path_str(path)}
        if isinstance(node, dict):
            for k in node:
                if not isinstance(k, str):
                    raise TypeError(
                        f"dict key {k!r} at {path_str(path) or '<root>'!r} is a {type(k).__name__}; "
                        "ckptio needs str keys"
                    )
            return {"dict": {k: walk(v, (*path, k)) for k, v in node.items()}}
        if type(node) in (list, tuple):
            return {type(node).__name__: [walk(v, (*path, i)) for i, v in enumerate(node)]}
        leaves.append((path, node))
        return {"leaf": path_str(path)}

    structure = walk(tree, ())
    return leaves, structure


def unflatten(structure: Any, leaf_for: Callable[[str], Any]) -> Any:
    """Rebuild the tree of ``structure``, asking ``leaf_for(path_str)`` for each leaf."""
    if not isinstance(structure, dict) or len(structure) != 1:
        raise ValueError(f"malformed tree node {str(structure)[:80]!r}")
    (kind, body), = structure.items()
    if kind == "leaf" and isinstance(body, str):
        return leaf_for(body)
    if kind == "dict" and isinstance(body, dict):
        return {k: unflatten(v, leaf_for) for k, v in body.items()}
    if kind in ("list", "tuple") and isinstance(body, list):
        seq = [unflatten(v, leaf_for) for v in body]
        return seq if kind == "list" else tuple(seq)
    raise ValueError(f"malformed tree node of kind {kind!r}")


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

