"""The backends' private helpers stay theirs: the core shares system helpers through ``ckptio.system``.

That the backends import nothing above them (only each other, ``ckptio.system`` and
``ckptio.errors``) is the layer table's rule, checked by tests/test_architecture.py.
Read from the source, so no import order can hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

from paths import REPO

ROOT = REPO


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
