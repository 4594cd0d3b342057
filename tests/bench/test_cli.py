"""``ckptio bench``'s command line: help, a case name that does not exist, where a gs:// URL goes,
the goals table's title and the plot's title (none of these run a benchmark)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from ckptio.bench import report
from ckptio.bench.cli import _open_target, build_parser, main


def test_help_describes_gcs_and_the_fake_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(later)" not in out and "gs://BUCKET/PREFIX" in out and "real bucket" in out and "--fake-gcs" in out


@pytest.mark.parametrize("flag", ["--cases", "--skip"])
def test_a_case_name_that_does_not_exist_is_an_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([flag, "ckptio,nonesuch", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "'nonesuch'" in err and "--list" in err and "'ckptio'" not in err


def test_the_goals_table_has_no_internal_issue_numbers() -> None:
    out = io.StringIO()
    goals = [{"case": "ckptio", "figure": "save_gibps", "vs": "raw-disk", "goal": ">= 0.9", "ratio": 1.2, "met": True}]
    report.render_goals(goals, out=out)
    text = out.getvalue()
    assert "goals" in text and "issue" not in text.lower() and "met" in text


def _args(*argv: str) -> Any:
    return build_parser().parse_args(list(argv))


def test_a_real_gs_url_means_the_real_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptio.backends._gcs_config import GCS_ENDPOINT

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("CKPTIO_BENCH_GCS_ENDPOINT", raising=False)
    target: Any = _open_target(_args("--backend", "gs://my-bucket/bench"))  # builds offline; no request yet
    try:
        assert target.endpoint == GCS_ENDPOINT and not target.fresh_server_per_case and target.bucket == "my-bucket"
    finally:
        target.close()


def test_the_emulator_is_explicit_with_fake_gcs(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptio.bench.fakegcs import binary_path

    if binary_path() is None:
        pytest.skip("fake-gcs-server binary not installed")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # --fake-gcs wins over it
    target: Any = _open_target(_args("--fake-gcs"))
    try:
        assert target.fresh_server_per_case and target.bucket == "bench"
    finally:
        target.close()
    with pytest.raises(ValueError, match="--fake-gcs"):
        _open_target(_args("--fake-gcs", "--backend", "/tmp"))


def test_the_plot_title_fits_in_the_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from ckptio.bench.plot import figure

    title = ("ckptio bench — 1.0 GiB as 32 × float32, 3 rounds, target /tmp/some/rather/long/dir/ckptio-bench-x1y2z3, "
             "cold reads: drop_caches (page cache dropped before every restore)")
    summary = {f: {"median": 1.0, "min": 0.9, "max": 1.1}
               for f in ("save_gibps", "restore_gibps", "stall_s", "save_rss_mib", "restore_rss_mib")}
    results = [{"case": c, "status": "ok", "kind": "ckptio", "summary": summary} for c in ("ckptio", "raw-disk")]
    fig = figure(results, title)
    fig.canvas.draw()
    box, page = fig._suptitle.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)
    for ax in fig.axes:  # and the panels start below it
        if ax.get_visible():
            assert ax.get_tightbbox().y1 <= box.y0 + 1
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_interleave_refuses_the_per_case_fake_gcs_server(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--interleave", "--fake-gcs", "--cases", "ckptio", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--interleave" in err and "--fake-gcs" in err and "Traceback" not in err


def _fake_doc(ckptio_save: float) -> dict[str, Any]:
    def case(name: str, kind: str, save: float) -> dict[str, Any]:
        fig = {"median": save, "min": save, "max": save, "n": 1}
        return {"case": name, "kind": kind, "framework": "numpy", "description": "", "durability": "",
                "status": "ok", "samples": [], "summary": {"save_gibps": fig, "restore_gibps": fig}}

    return {"config": {"state": {"total_bytes": 1 << 20, "count": 32, "dtype": "float32"}, "rounds": 1,
                       "target": {"dir": "/tmp/x"}},
            "cache_drop": {"method": "none"},
            "cases": [case("raw-disk", "anchor", 1.0), case("ckptio", "ckptio", ckptio_save)]}


@pytest.mark.parametrize("ckptio_save, check, code", [(0.5, True, 1), (0.5, False, 0), (1.0, True, 0)])
def test_the_default_run_is_the_quick_set_with_one_verdict_line_and_check_exits_1_on_a_miss(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        ckptio_save: float, check: bool, code: int) -> None:
    """#36: the default bench is the quick set (``--full`` for every case and the ratio tables); one
    line says how many judged goals were met; ``--check`` exits 1 when one was missed."""
    from ckptio.bench import cli
    from ckptio.bench.harness import QUICK_CASES

    seen: list[Any] = []
    monkeypatch.setattr(cli, "_measure", lambda args, argv: seen.append(args.cases) or _fake_doc(ckptio_save))
    assert main(["--no-progress", *(["--check"] if check else [])]) == code
    assert seen == [list(QUICK_CASES)]
    out = capsys.readouterr().out
    assert "÷ each case" not in out  # the ratio tables are --full's
    assert "quick set: " in out and "--full" in out  # the summary says what the default left out
    met = "0 of 2 met" if ckptio_save < 0.9 else "2 of 2 met"
    assert f"goals: {met}" in out
    if ckptio_save < 0.9:
        assert "missed: ckptio save GiB/s vs raw-disk, ckptio restore GiB/s vs raw-disk" in out
    assert main(["--no-progress", "--full"]) == 0 and seen[-1] is None  # every default case
    full = capsys.readouterr().out
    assert "÷ each case" in full and "quick set: " not in full
    assert main(["--full", "--cases", "ckptio"]) == 2
