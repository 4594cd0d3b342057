"""ckptio.system.arrays: numpy's sorted unique values, without its first-call ``numpy.ma`` import.

numpy 2's ``np.unique`` without index outputs imports ``numpy.ma`` (and ``inspect``) the first
time: about 0.9 MiB of RSS, which a process paid inside its first read-once restore. The
helpers give what ``np.unique`` gives, and a restore by logical-box exchange in a fresh process
imports no ``numpy.ma``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import REPO, SUPPORT

from ckptio.system import unique, unique_rows

PROFILE = settings(max_examples=80, derandomize=True, deadline=None)
_INTS = st.integers(-4, 4)


@PROFILE
@given(st.lists(_INTS, max_size=40), st.sampled_from([np.int64, np.int32, np.uint8]))
def test_unique_gives_what_np_unique_gives(values: list[int], dtype: type) -> None:
    a = np.array(values, dtype=np.int64).astype(dtype)
    got, want = unique(a), np.unique(a)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()


@PROFILE
@given(st.integers(1, 3).flatmap(lambda w: st.lists(st.lists(_INTS, min_size=w, max_size=w), max_size=30)
                                 .map(lambda rows: np.array(rows, np.int64).reshape(-1, w))))
def test_unique_rows_gives_what_np_unique_axis_0_gives(rows: np.ndarray) -> None:
    got, want = unique_rows(rows), np.unique(rows, axis=0)
    assert got.shape == want.shape and got.tolist() == want.tolist()


def test_a_restore_by_exchange_in_a_fresh_process_imports_no_numpy_ma(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(SUPPORT)!r}]\n"
        "from tests.restoring import test_boxexchange as t\n"
        "before = 'numpy.ma' in sys.modules\n"
        f"root = Path({str(tmp_path)!r})\n"
        "t._save(root)\n"
        "out = t._restore_on(root, 3)\n"
        "assert len(out) == 3\n"
        "print(before, 'numpy.ma' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "False"], run.stdout
