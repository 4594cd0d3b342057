"""``ckptio bench --accel`` on CPU devices: every case saves and restores bit-exact and reports each
figure (on an accelerator the same code measures the chip; bench/accel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

from ckptio.bench.accel import CASES, render_accel, run_accel  # noqa: E402
from ckptio.bench.cli import main  # noqa: E402


def test_every_case_restores_bit_exact_and_reports_its_figures(tmp_path: Path) -> None:
    res = run_accel(8 << 20, rounds=1, parent=str(tmp_path), arrays=4, step_ms=0.1)
    assert res["bytes"] == 8 << 20 and res["d2h_s"] >= 0 and res["device_copy_s"] > 0
    assert set(res["cases"]) == set(CASES)
    for name, case in res["cases"].items():
        assert "error" not in case, (name, case)
        assert case["bit_exact"] and case["stall_s"] > 0 and case["commit_s"] >= case["stall_s"], name
        assert case["restore_gibs"] > 0 and case["rss_mib"] is not None, name
    table = render_accel(res)
    assert all(name in table for name in CASES) and " NO" not in table


def test_the_cli_names_an_unknown_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--accel", "--accel-cases", "ckptio,tpu"]) == 2
    assert "'tpu'" in capsys.readouterr().err
