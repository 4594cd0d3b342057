"""The shape of the code, checked: imports follow the layer table of docs/architecture.md (none
runs up a layer, none crosses to a package beside it), no cycle, and nothing past its size limits.

The table in docs/architecture.md is the one source of truth: these tests parse it. They read the
source with ``ast`` (nothing is imported), so they see imports hidden inside functions and
``TYPE_CHECKING`` blocks too: an import moved into a function to dodge a layer is still an edge.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Trees and the package each installs as (``backends/`` installs as ``ckptio.backends``).
TREES = {ROOT / "ckptio": "ckptio", ROOT / "backends": "ckptio.backends", ROOT / "bench": "ckptio.bench"}
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


def layer_table(text: str | None = None) -> list[list[str]]:
    """docs/architecture.md's layer table, bottom to top: each row's packages."""
    text = (ROOT / "docs" / "architecture.md").read_text() if text is None else text
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[1].startswith("`ckptio"):
            rows.append(re.findall(r"`(ckptio[\w.]*)`", cells[1]))
    return rows


def _home(module: str, rows: list[list[str]]) -> tuple[int, str] | None:
    """The row and package of ``module``: the longest package of the table that holds it (``ckptio``
    itself holds only the package's ``__init__``)."""
    best: tuple[int, str] | None = None
    for i, packages in enumerate(rows):
        for p in packages:
            holds = module == p or (p != "ckptio" and module.startswith(p + "."))
            if holds and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return best


def upward_imports(graph: dict[str, list[str]], rows: list[list[str]]) -> list[str]:
    """Every import that runs up a layer or across to a package beside it, and every module no row holds."""
    wrong = [f"{m}: in no row of the layer table" for m in graph if _home(m, rows) is None]
    for m, targets in graph.items():
        here = _home(m, rows)
        for t in targets:
            there = _home(t, rows)
            if here is None or there is None or there[1] == here[1] or there[0] < here[0]:
                continue
            where = "up a layer" if there[0] > here[0] else "across its layer"
            wrong.append(f"{m} imports {t} ({where}: {here[1]} -> {there[1]})")
    return sorted(wrong)


def test_every_import_follows_the_layer_table() -> None:
    rows = layer_table()
    assert len(rows) >= 10, rows  # the table parsed
    assert upward_imports({m: sorted(set(_imports(m))) for m in MODULES}, rows) == []


def test_the_layer_check_fails_on_a_planted_upward_import() -> None:
    """The check is not vacuous: the engine importing the store, or the store a package beside it,
    is caught; so is a module the table has no row for."""
    rows = layer_table()
    graph = {"ckptio.engine.core": ["ckptio.store.facade"], "ckptio.store.facade": ["ckptio.engine.core"],
             "ckptio.saving.job": ["ckptio.restoring.planner"], "ckptio.stray": []}
    assert upward_imports(graph, rows) == [
        "ckptio.engine.core imports ckptio.store.facade (up a layer: ckptio.engine -> ckptio.store)",
        "ckptio.saving.job imports ckptio.restoring.planner (across its layer: ckptio.saving -> ckptio.restoring)",
        "ckptio.stray: in no row of the layer table",
    ]


def test_the_top_of_ckptio_is_only_its_public_face() -> None:
    """ckptio/ holds packages by layer; the only modules at its top are ``__init__``, ``api`` and ``errors``."""
    top = {p.name for p in (ROOT / "ckptio").glob("*.py")}
    assert top == {"__init__.py", "api.py", "errors.py"}


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not m.startswith("ckptio.bench")))
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
        "from ckptio.state.dtypes import decode_dtype\n"
        "assert str(decode_dtype('bfloat16')) == 'bfloat16'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_module_is_hidden_by_a_name_of_its_package() -> None:
    """``from ckptio.restoring import plan`` must not give a function where a module of that name
    exists (``import ckptio.x.y`` and ``ckptio.x.y`` would then disagree), nor may ``ckptio.save`` or
    ``ckptio.restore`` (the functions) share a name with a package."""
    hidden = []
    for name, path in MODULES.items():
        if not _is_package(name):
            continue
        subs = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == name}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                bound = [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
                hidden += [f"{name}.{b}" for b, full in bound if b in subs and full != f"{name}.{b}"]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in subs:
                hidden.append(f"{name}.{node.name}")
    assert hidden == []
