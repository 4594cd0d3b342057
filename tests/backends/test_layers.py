"""The backends sit at the bottom: they import only each other and ckptio's system helpers.

``ckptio.system`` (byte views, fresh pages, background threads) is below them and
imports nothing of ckptio; the backends import nothing above themselves (no manifest,
store, engine: Hyperdisk ML's ``publish`` lives in :mod:`ckptio.manage.hdml_publish` for that),
not even inside a function. Read from the source, so no import order can hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from paths import REPO

ROOT = REPO
BACKENDS = sorted((ROOT / "backends").glob("*.py"))
SYSTEM = sorted((ROOT / "ckptio" / "_system").glob("*.py"))


def _ckptio_imports(path: Path, package: str) -> set[str]:
    """Every ckptio module ``path`` imports, anywhere in it (relative imports resolved in ``package``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "ckptio")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, *([node.module] if node.module else [])]))
            elif node.module and node.module.split(".")[0] == "ckptio":
                found.add(node.module)
    return found


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: p.name)
def test_a_backend_imports_nothing_above_the_backends(path: Path) -> None:
    above = {m for m in _ckptio_imports(path, "ckptio.backends")
             if not m.startswith(("ckptio.backends", "ckptio.system"))}
    assert not above, f"backends/{path.name} reaches up into {sorted(above)}"


@pytest.mark.parametrize("path", SYSTEM, ids=lambda p: p.name)
def test_the_system_helpers_import_nothing_of_ckptio(path: Path) -> None:
    outside = {m for m in _ckptio_imports(path, "ckptio.system") if not m.startswith("ckptio.system")}
    assert not outside, f"ckptio/_system/{path.name} imports {sorted(outside)}"


def test_core_modules_import_no_private_backend_helper() -> None:
    """Core modules share the system helpers through ckptio.system, not through the backends' privates."""
    private = "ckptio.backends._"
    users = {
        str(path.relative_to(ROOT)): hits
        for path in (ROOT / "ckptio").rglob("*.py")
        if (hits := sorted(m for m in _ckptio_imports(path, _package_of(path)) if m.startswith(private)))
    }
    assert not users, users


def _package_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts if path.name == "__init__.py" else parts[:-1]).removesuffix(".__init__")
