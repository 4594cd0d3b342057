"""The README's example third-party backend (tests/support/example_backend.py) proves the contract with
ckptio.testing, as a backend outside this repository would, and carries a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from example_backend import SQLiteBackend
from paths import REPO

import ckptio
from ckptio.testing import BackendConformance


class TestSQLiteBackend(BackendConformance):
    def make_backend(self, tmp_path: Path) -> SQLiteBackend:
        # The same tmp_path gives another client of the same file: the commit race needs two.
        return SQLiteBackend(f"sqlite://{tmp_path}/objects.db")


def test_a_checkpoint_saved_and_restored_through_the_example_backend(tmp_path: Path) -> None:
    state = {"w": np.arange(1000, dtype=np.float32).reshape(10, 100), "step": 3}
    url = f"sqlite://{tmp_path}/ckpt.db"
    ckptio.save(url, state, step=3, backend=SQLiteBackend(url)).result()
    back = ckptio.restore(url, backend=SQLiteBackend(url))
    assert back["step"] == 3 and np.array_equal(back["w"], state["w"])


def test_the_docs_show_this_very_example() -> None:
    example = (REPO / "tests" / "support" / "example_backend.py").read_text().rstrip()
    assert example in (REPO / "docs" / "backends.md").read_text()
