"""Native save from N real processes (torch.distributed, gloo), restored by M with another split."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from paths import WORKERS  # noqa: E402

from ckptio.bench.readonce import spawn  # noqa: E402

WORKER = str(WORKERS / "mp_native_worker.py")


def run_ranks(n: int, *args: str, timeout: float = 120) -> None:
    """Run the worker in ``n`` processes and fail with their output if any fails."""
    spawn(WORKER, n, list(args), timeout)


@pytest.mark.slow
@pytest.mark.parametrize("savers", [2, 4])
def test_save_n_restore_1_and_2_with_another_split(tmp_path, savers):
    root = str(tmp_path / "ckpt")
    run_ranks(savers, "save", root)
    run_ranks(1, "restore", root)
    run_ranks(2, "restore", root)
