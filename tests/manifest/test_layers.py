"""ckptio.manifest is layered: each of its modules imports only the ones below it, at module level.

The order is the package docstring's; a module that needs one above it (or hides an import
inside a function to dodge a cycle) fails here, naming both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptio.manifest

#: Bottom to top: a module may import (from ckptio.manifest) only modules listed before it.
LAYERS = [
    "names",
    "limits",
    "formats",
    "model",
    "geometry",
    "table",
    "values",
    "sealing",
    "hoststate",
    "itemjson",
    "refs",
    "codec.packs",
    "codec.arrays",
    "codec.rowcheck",
    "codec.columns",
    "codec.sections",
    "codec.wholes",
    "codec.gather",
    "codec.single",
    "codec.split",
    "codec",
    "fragments",
    "lazy",
    "builder",
]

PACKAGE = Path(ckptio.manifest.__file__).parent


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str) -> tuple[set[str], list[int]]:
    """The package modules ``path`` imports at module level, and the lines of imports inside functions."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptio.manifest"):
            name = node.module.removeprefix("ckptio.manifest").lstrip(".")
            for alias in node.names:
                full = f"{name}.{alias.name}" if name else alias.name
                found.add(full if full in LAYERS else name)
    hidden = [n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return {m for m in found if m in LAYERS}, hidden


def test_every_module_of_the_package_is_in_a_layer() -> None:
    modules = {_module_of(p) for p in PACKAGE.rglob("*.py")} - {""}
    assert modules == set(LAYERS)


def test_manifest_modules_import_only_down_and_never_inside_functions() -> None:
    for path in PACKAGE.rglob("*.py"):
        module = _module_of(path)
        if not module:
            continue  # the package itself re-exports everything
        deps, hidden = _imports(path, module)
        assert not hidden, f"{module} imports inside functions (lines {hidden})"
        for dep in deps:
            assert LAYERS.index(dep) < LAYERS.index(module), f"{module} imports {dep}, which sits above it"
