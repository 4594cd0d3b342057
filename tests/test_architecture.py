"""The shape of the code, checked: imports point down (no cycles) and nothing grows past its size limits.

Issue #31 gave every concern one home; these tests keep it that way. They read the source with
``ast`` (nothing is imported), so they are fast and see imports hidden inside functions too: an
import moved into a function to dodge a cycle is still a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Library trees and the package each installs as (``backends/`` installs as ``ckptio.backends``).
TREES = {ROOT / "ckptio": "ckptio", ROOT / "backends": "ckptio.backends"}
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for top, package in TREES.items():
        for path in sorted(top.rglob("*.py")):
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> Iterator[str]:
    """The ckptio modules ``name`` imports anywhere in its body (functions included)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    base = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` imports mod.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # ``import ckptio.backends.local`` -> that module
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {m: sorted(set(_imports(m))) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_import_graph_has_no_cycle() -> None:
    assert _cycles() == []


def test_backends_import_nothing_above_them() -> None:
    """Backends only move bytes: they may import each other and the bottom-layer helpers, never the core."""
    allowed = ("ckptio.backends", "ckptio._system", "ckptio.errors")
    wrong = {
        (m, t) for m in MODULES if m.startswith("ckptio.backends")
        for t in _imports(m) if not t.startswith(allowed) and t != "ckptio"
    }
    assert wrong == set()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_and_function_sizes(name: str) -> None:
    source = MODULES[name].read_text()
    assert source.count("\n") <= MAX_MODULE_LINES, f"{name}: {source.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], f"{name}: " + ", ".join(long)


def test_the_graph_reader_sees_a_known_edge() -> None:
    """Guard against the checks above passing vacuously (a reader that finds no imports)."""
    assert "ckptio.backends.base" in set(_imports("ckptio.backends.local"))


def test_every_package_is_installed() -> None:
    """pyproject lists packages by name: a new package left out imports in an editable install only."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {m for m in MODULES if _is_package(m) and not m.startswith("ckptio.bench")} | {"ckptio.bench"}
    assert packages - listed == set()


def test_import_ckptio_loads_no_framework_and_no_ml_dtypes() -> None:
    """`import ckptio` (and so every CLI call) stays light: no torch, jax or ml_dtypes (whose import
    alone took ~1.4 s here) until a save or restore needs one; a bfloat16 manifest still decodes."""
    import subprocess
    import sys

    code = (
        "import sys, ckptio, ckptio.cli\n"
        "heavy = [m for m in ('torch', 'jax', 'ml_dtypes') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from ckptio.dtypes import decode_dtype\n"
        "assert str(decode_dtype('bfloat16')) == 'bfloat16'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
