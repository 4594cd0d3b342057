"""``ckptio bench`` end to end at a tiny size, plus the harness's small pure parts.

The end-to-end run is one subprocess (4 MiB, 1 round, every default case)
shared by the tests of this module; it takes ~20-30 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptio.bench.advise import young_daly
from ckptio.bench.harness import run_interleaved, run_job
from ckptio.bench.spec import FIGURES, Job, StateSpec, parse_duration, parse_size
from ckptio.bench.system import drop_cache, resident_fraction
from ckptio.bench.targets import LocalTarget


def _have(*mods: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in mods)


# Decided here, independently of the harness's own availability checks.
EXPECTED_ANCHORS = ["raw-disk", "raw-direct", "raw-direct-snapshot"]
if _have("jax", "orbax.checkpoint"):
    EXPECTED_ANCHORS += ["orbax-default", "orbax-nocomp"]
if _have("tensorstore"):
    EXPECTED_ANCHORS += ["tensorstore-zarr3"]
if _have("torch"):
    EXPECTED_ANCHORS += ["dcp", "dcp-async", "torch-save"]
CKPTIO_CASES = ["ckptio"] + (["ckptio-jax"] if _have("jax") else []) + (
    ["ckptio-orbax"] if _have("orbax.checkpoint") else []
) + (
    ["ckptio-torch", "ckptio-dcp", "ckptio-dcp-async"] if _have("torch") else []
)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "ckptio.bench", "--full", "--size", "4MiB", "--rounds", "1", "--dir", str(out / "work"),
           "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"), "--advise", "--mtbf", "4h"]
    # Every case's worker imports its framework: minutes on a loaded 2-core machine (pytest's own
    # 600 s timeout covers a hang).
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "bench.json").read_text())
    return proc, doc, out


def _case(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in doc["cases"] if c["case"] == name]
    assert found, f"{name} missing from the JSON (cases: {[c['case'] for c in doc['cases']]})"
    return found[0]


def _assert_every_figure(result: dict[str, Any]) -> None:
    assert result["status"] == "ok", result.get("error")
    for fig, _, _ in FIGURES:
        s = result["summary"].get(fig)
        assert s is not None, f"{result['case']}: no {fig}"
        assert all(math.isfinite(s[k]) for k in ("median", "min", "max")), (result["case"], fig, s)
        assert s["min"] <= s["median"] <= s["max"]
    assert result["summary"]["save_gibps"]["median"] > 0
    assert result["summary"]["restore_gibps"]["median"] > 0
    for sample in result["samples"]:  # the raw samples are there, not only the summary
        for key in ("save_s", "stall_s", "restore_s", "save_rss_bytes", "restore_rss_bytes"):
            assert sample[key] is not None, (result["case"], key)
        assert sample["stall_s"] <= sample["save_s"] + 1e-9
        assert sample["verified"] is True
        assert sample["restore_sys_s"] >= 0 and sample["restore_user_s"] >= 0  # the process's CPU in the restore


@pytest.mark.slow  # shares one full bench run (every anchor), minutes
@pytest.mark.parametrize("name", EXPECTED_ANCHORS)
def test_every_installed_anchor_has_every_figure(bench_run: Any, name: str) -> None:
    _, doc, _ = bench_run
    _assert_every_figure(_case(doc, name))


@pytest.mark.slow  # shares one full bench run (every anchor), minutes
@pytest.mark.parametrize("name", CKPTIO_CASES)
def test_every_ckptio_case_has_every_figure(bench_run: Any, name: str) -> None:
    _, doc, _ = bench_run
    _assert_every_figure(_case(doc, name))


@pytest.mark.slow  # shares one full bench run (every anchor), minutes
def test_run_records_environment_and_outputs(bench_run: Any) -> None:
    proc, doc, out = bench_run
    assert doc["schema"] == "ckptio.bench/1"
    assert doc["cache_drop"]["method"] in ("drop_caches", "fadvise", "none")
    assert doc["cache_drop"]["reason"]
    assert doc["config"]["state"] == {"total_bytes": 4 << 20, "count": 32, "dtype": "float32", "seed": 0}
    assert doc["env"]["versions"]["numpy"]
    assert doc["rss_method"]
    raw = _case(doc, "raw-disk")
    assert raw["samples"][0]["cache_drop"] == doc["cache_drop"]["method"]
    if doc["cache_drop"]["method"] != "none":
        resident = raw["samples"][0]["resident_before_restore"]  # mincore after the drop
        assert resident is None or resident < 0.05
    # ratios of every ok case to every other, and to the raw disk
    assert "orbax-default" not in EXPECTED_ANCHORS or doc["ratios"]["orbax-default"]["raw-disk"]["save_gibps"] > 0
    assert {g["vs"] for g in doc["goals"]} >= {"raw-disk"}
    assert any(a["case"] == "raw-disk" and a["interval_s"] > 0 for a in doc["advise"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "raw-disk" in proc.stdout and "goals" in proc.stdout
    assert not any((out / "work").iterdir()), "the bench left checkpoints behind"


@pytest.mark.slow  # shares one full bench run (every anchor), minutes
@pytest.mark.skipif(not _have("jax", "orbax.checkpoint", "tensorstore"), reason="needs orbax + tensorstore")
def test_orbax_compression_is_verified_from_disk(bench_run: Any) -> None:
    _, doc, _ = bench_run
    assert _case(doc, "orbax-default")["info"]["compressor"]["id"] == "zstd"
    assert _case(doc, "orbax-nocomp")["info"]["compressor"] is None


def test_a_failing_case_is_an_error_row_not_a_crash(tmp_path: Path) -> None:
    target = LocalTarget(str(tmp_path))
    job = Job(case="no-such-case", root=target.case_root("x"), state=StateSpec(1 << 16, 2), rounds=1)
    result = run_job(job, target, timeout_s=60)
    assert result["status"] == "error" and "no-such-case" in result["error"]
    target.close()


def test_interleaved_jobs_take_their_rounds_in_turn(tmp_path: Path) -> None:
    """--interleave: round r of every case runs after round r-1 of every case and before round r+1
    of any; every job still completes (verified), and a failing job is an error row, not a hang."""
    target = LocalTarget(str(tmp_path))
    cases = ["raw-disk", "ckptio", "no-such-case", "memcpy"]
    jobs = [Job(case=c, root=target.case_root(c), state=StateSpec(1 << 20, 4), rounds=3, cache_drop="none",
                gated=True) for c in cases]
    events: list[list[dict[str, Any]]] = [[] for _ in jobs]
    results = run_interleaved(jobs, target, [120.0] * len(jobs), [evs.append for evs in events])
    target.close()
    assert [r["case"] for r in results] == cases
    bad = results[2]
    assert bad["status"] == "error" and "no-such-case" in bad["error"]
    good = [r for r in results if r is not bad]
    for r in good:
        assert r["status"] == "ok", r.get("error")
        assert [s["round"] for s in r["samples"]] == [0, 1, 2]
    order = sorted((s["started_at"], s["round"], r["case"]) for r in good for s in r["samples"])
    assert [(rnd, case) for _, rnd, case in order] == [(rnd, c) for rnd in range(3) for c in ("raw-disk", "ckptio", "memcpy")]
    assert [e["round"] for e in events[1] if e.get("event") == "round_done"] == [0, 1, 2]


def test_run_interleaved_refuses_jobs_that_would_not_wait_for_their_turn(tmp_path: Path) -> None:
    target = LocalTarget(str(tmp_path))
    job = Job(case="ckptio", root=target.case_root("ckptio"), state=StateSpec(1 << 16, 2), rounds=1)
    with pytest.raises(ValueError, match="gated"):
        run_interleaved([job], target, [60.0], [lambda e: None])
    target.close()


@pytest.mark.parametrize("case, background", [("ckptio", True), ("raw-disk", False)])
def test_train_mode_times_host_steps_during_background_saves(tmp_path: Path, case: str, background: bool) -> None:
    """--train: idle step time every round; step times during the save only where it runs in the background."""
    from ckptio.bench import report

    target = LocalTarget(str(tmp_path))
    job = Job(case=case, root=target.case_root(case), state=StateSpec(8 << 20, 4), rounds=2, train=True,
              cache_drop="none")
    result = run_job(job, target, timeout_s=120)
    target.close()
    assert result["status"] == "ok", result.get("error")
    for sample in result["samples"]:
        assert sample["train_idle_s"] > 0 and sample["train_idle_cpu_s"] > 0
        assert (sample.get("train_cpu_s", 0) > 0) == background, sample
        assert (sample.get("train_steps", 0) >= 1) == background, sample
        assert (sample.get("train_busy_s", 0) > 0) == background, sample
        assert (sample.get("train_blocked_s", -1) >= 0) == background, sample
    assert ("train_slowdown" in report.summarize(result)) == background


@pytest.mark.slow  # DCP's checkpoint process beside the bench worker
@pytest.mark.skipif(not _have("torch"), reason="needs torch")
@pytest.mark.parametrize("case", ["dcp-async-process", "ckptio-dcp-async-process"])
def test_dcp_process_executor_cases_save_restore_and_end_their_process(tmp_path: Path, case: str) -> None:
    """The opt-in DCP process-executor cases: DCP's background process writes a checkpoint that
    restores bit-exact, and that process does not outlive the worker (which exits without teardown)."""
    from ckptio.bench import report

    target = LocalTarget(str(tmp_path))
    job = Job(case=case, root=target.case_root(case), state=StateSpec(4 << 20, 4), rounds=2, cache_drop="none")
    result = run_job(job, target, timeout_s=180)
    target.close()
    _assert_every_figure({**result, "summary": report.summarize(result)})
    assert all(s["async_save"] for s in result["samples"])
    # The worker names its own descendants as it finishes: DCP's checkpoint process among them
    # (spawned, so multiprocessing's resource tracker too). Only those are checked, never
    # whatever else the machine happens to start meanwhile (the suite's own tracker, say).
    started = result["descendants"]
    assert started, "the worker had no DCP checkpoint process running"
    # They see their pipes close when the worker exits and end themselves, a moment later.
    left = _still_running(started, timeout_s=30)
    assert not left, f"DCP's checkpoint process outlived the bench worker: {left}"


def _still_running(procs: list[dict[str, float]], timeout_s: float) -> list[str]:
    """Which of ``procs`` (pid and start time, as the worker recorded them) still run after
    waiting up to ``timeout_s``. A zombie has ended: orphaned, it waits on whatever pid 1 is
    to reap it, which is no part of what is tested. A pid now held by a process that started
    at another time is someone else's: seconds apart, as the kernel's boot time (which the
    start time is counted from) can move by a second between the worker's look and ours."""
    import psutil

    def running(rec: dict[str, float]) -> str | None:
        try:
            p = psutil.Process(int(rec["pid"]))
            if abs(p.create_time() - rec["create_time"]) > 2.0 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return f"{p.pid} {' '.join(p.cmdline())[:200]!r}"
        except psutil.NoSuchProcess:
            return None

    end = time.monotonic() + timeout_s
    while True:
        left = [r for r in (running(rec) for rec in procs) if r is not None]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


def test_train_slowdown_cancels_core_speed_drift() -> None:
    """A core 30 % slower during the save than when idle, with no time lost to the save: 1.0x,
    nothing lost; the same steps with a fifth of their wall time spent off the core: 1.25x."""
    from ckptio.bench import train

    idle = {"train_idle_s": 1e-3, "train_idle_cpu_s": 1e-3}
    drift = {**idle, "train_busy_s": 1.3e-3, "train_cpu_s": 1.3e-3, "train_steps": 100}
    assert train.slowdown(drift) == pytest.approx(1.0)
    assert train.lost_s(drift) == pytest.approx(0.0, abs=1e-12)
    waits = {**drift, "train_busy_s": 1.625e-3}
    assert train.slowdown(waits) == pytest.approx(1.25)
    assert train.lost_s(waits) == pytest.approx(100 * 0.325e-3)
    assert train.slowdown(idle) is None and train.lost_s(idle) is None  # a synchronous save


def test_train_during_reraises_the_save_failure() -> None:
    from ckptio.bench import train

    def failing_wait() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        train.during(failing_wait)
    assert train.during(lambda: None)["train_steps"] >= 1


def test_train_window_keeps_stepping_past_the_save_and_bills_the_save_only_its_own_time(tmp_path: Path) -> None:
    """--train-window: the step is timed until the window's end, the in-save figures stay the
    save's own, and the save's time and CPU are read the moment it returns, not at the window's end."""
    from ckptio.bench import report, train

    ended: list[float] = []
    got = train.during(lambda: None, window_s=0.2, on_done=lambda: ended.append(time.perf_counter()))
    assert len(ended) == 1
    assert got["train_window_s"] >= 0.2 and got["train_window_steps"] > got["train_steps"] >= 1
    assert train.windowed({"train_idle_s": 1e-3, "train_idle_cpu_s": 1e-3, **got})["train_steps"] == \
        got["train_window_steps"]
    assert train.windowed({"train_busy_s": 1.0}) is None  # no window: nothing to read

    target = LocalTarget(str(tmp_path))
    job = Job(case="ckptio", root=target.case_root("ckptio"), state=StateSpec(4 << 20, 4), rounds=2, train=True,
              train_window_s=3.0, cache_drop="none")
    result = run_job(job, target, timeout_s=120)
    target.close()
    assert result["status"] == "ok", result.get("error")
    for sample in result["samples"]:
        assert sample["train_window_s"] >= 3.0
        assert sample["save_s"] < sample["train_window_s"]  # a 4 MiB save is not billed the window
        assert sample["train_window_steps"] > sample["train_steps"]
    summary = report.summarize(result)
    assert "train_window_slowdown" in summary and "train_slowdown" in summary


def test_parse_size_and_duration() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4M") == 4 << 20
    assert parse_size("1GB") == 10**9
    assert parse_duration("4h") == 14400
    assert parse_duration("30m") == 1800
    with pytest.raises(ValueError):
        parse_size("lots")


def test_young_daly() -> None:
    tau, loss = young_daly(cost_s=2.0, mtbf_s=4 * 3600)
    assert tau == pytest.approx(math.sqrt(2 * 2.0 * 14400))
    assert loss == pytest.approx(math.sqrt(2 * 2.0 / 14400))  # at the optimum: sqrt(2C/M)
    assert young_daly(0.0, 3600) == (0.0, 0.0)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_fadvise_drop_empties_the_page_cache_of_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(np.random.default_rng(0).bytes(8 << 20))
    (tmp_path / "f.bin").read_bytes()
    before = resident_fraction(tmp_path)
    if before is None:
        pytest.skip("mincore unavailable")
    assert drop_cache("fadvise", tmp_path) == "fadvise"
    after = resident_fraction(tmp_path)
    assert after is not None and after < 0.05 <= before


def test_reshard_summary_compares_the_column_block_with_both_same_layout_restores() -> None:
    from ckptio.bench.reshard import render_reshard, reshard_summary

    def row(layout: str, saved: str, restored: str, seconds: float, read: int) -> dict[str, Any]:
        return {"layout": layout, "saved": saved, "restored": restored, "save_s": 1.0, "restore_s": seconds,
                "vs_same_layout": 1.0, "bytes_read": read, "bytes_needed": 64, "peak_rss_extra": None,
                "bit_exact": True}

    res = {"array": [16, 16], "bytes": 1024, "blocks": 16, "cache_drop": "none", "rounds": 1, "rows": [
        row("tiled", "row blocks", "row block", 0.2, 64),
        row("tiled", "row blocks", "column block", 0.15, 96),
        row("C order", "row blocks", "row block", 0.1, 64),
    ]}
    line = reshard_summary(res)
    assert line is not None and "read 1.50x" in line and "0.75x the tiled" in line and "1.50x the C-order" in line
    assert line in render_reshard(res)
    assert reshard_summary({**res, "rows": res["rows"][:2]}) is None  # no C-order run: no headline
