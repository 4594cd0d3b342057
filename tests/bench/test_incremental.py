"""``ckptio bench --incremental FRACTION`` runs both kinds of save side by side and reports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptio.bench.cli import main


def test_incremental_bench_writes_less_for_a_frozen_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--incremental", "0.1", "--size", "8MiB", "--arrays", "10", "--incremental-steps", "3",
                 "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["3"])]
    written = {(r[0], r[1]): float(r[2]) for r in rows}
    for step in ("2", "3"):
        assert written[(step, "incremental")] < written[(step, "full")] / 5  # 1 array of 10 changed
    assert "storage held" in out and "restore of step 3" in out
    assert not list(tmp_path.iterdir())  # its checkpoints go unless --keep


def test_incremental_bench_refuses_a_fraction_outside_0_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--incremental", "1.5"]) == 2
    assert "FRACTION must lie in [0, 1]" in capsys.readouterr().out
