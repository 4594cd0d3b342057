"""The bench's device limit (``raw-direct``), CPU cost per case, equalized memory and ``--pin``.

Properties only (what is reported, where it goes, what it counts), never timings: each job
runs a few MiB in a fresh worker process, as ``ckptio bench`` runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ckptio.bench import cpu, report
from ckptio.bench.anchors_direct import ALIGN, aligned_layout
from ckptio.bench.cli import main
from ckptio.bench.harness import run_job
from ckptio.bench.spec import Job, StateSpec
from ckptio.bench.targets import LocalTarget

# 3 arrays of 1 MiB + 4 bytes each (float32): sizes that are no multiple of a page.
ODD = StateSpec(3 * ((1 << 20) + 4), 3)


def _run(tmp_path: Path, case: str, spec: StateSpec = ODD, **kw: Any) -> dict[str, Any]:
    target = LocalTarget(str(tmp_path))
    job = Job(case=case, root=target.case_root(case), state=spec, rounds=2, cache_drop="none", **kw)
    try:
        result = run_job(job, target, timeout_s=180)
    finally:
        target.close()
    assert result["status"] == "ok", (result.get("error"), result.get("stderr_tail"))
    result["summary"] = report.summarize(result)
    return result


def test_aligned_layout_puts_every_array_on_a_page_and_balances_streams() -> None:
    sizes = {"a": 3 * ALIGN + 1, "b": 5, "c": 2 * ALIGN, "d": 7 * ALIGN}
    plan = aligned_layout(sizes, 2)
    assert sorted(k for p in plan for k in p) == sorted(sizes)
    for p in plan:
        spans = sorted((off, off + sizes[k]) for k, off in p.items())
        assert all(off % ALIGN == 0 for off, _ in spans)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # no overlap
    assert all(p for p in plan)  # both streams carry bytes


def test_raw_direct_restores_bit_exact_with_cpu_cost_and_a_floor(tmp_path: Path) -> None:
    result = _run(tmp_path, "raw-direct")
    for s in result["samples"]:
        assert s["verified"] is True
        assert s["save_cpu_s"] > 0 and s["restore_cpu_s"] > 0
        assert s["memory_state"] == "equalized" and s["equalize_s"] >= 0 and s["equalize_sys_s"] >= 0
    info = result["info"]
    assert info["streams"] == 4
    assert info["floor_copy_cpu_s_per_gib"] > 0 and info["floor_crc32c_cpu_s_per_gib"] > 0
    for fig in ("save_cpu_s_per_gib", "restore_cpu_s_per_gib"):
        assert result["summary"][fig]["median"] > 0
    floor = report.cpu_floor([{**result, "case": "raw-direct"}])
    assert floor is not None
    staged = info["floor_copy_cpu_s_per_gib"] + info["floor_crc32c_cpu_s_per_gib"]
    assert floor["save_cpu_s_per_gib"] == pytest.approx(staged + result["summary"]["save_cpu_s_per_gib"]["median"])


def test_raw_direct_snapshot_writes_what_it_copied_and_restores_bit_exact(tmp_path: Path) -> None:
    # Its buffers start empty (setup zeroes them), so a verified restore proves each save copied the state.
    result = _run(tmp_path, "raw-direct-snapshot")
    for s in result["samples"]:
        assert s["verified"] is True and s["save_cpu_s"] > 0
    assert result["info"]["streams"] == 4


def test_no_equalize_keeps_the_memory_as_it_is(tmp_path: Path) -> None:
    result = _run(tmp_path, "raw-disk", equalize=False)
    for s in result["samples"]:
        assert s["memory_state"] == "as-is" and "equalize_s" not in s
        assert s["restore_cpu_s"] > 0


def test_a_helper_process_cpu_is_counted() -> None:
    """A child's CPU (as the child itself measures it) is in the window's total, alive or reaped."""
    burn = "import os,time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\nprint(os.times().user+os.times().system)"
    before = cpu.snapshot()
    child = subprocess.run([sys.executable, "-c", burn], capture_output=True, text=True, check=True)
    after = cpu.snapshot()
    assert cpu.spent(before, after) >= float(child.stdout) * 0.95
    proc = subprocess.Popen([sys.executable, "-c", burn + "\nimport sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        own = float(proc.stdout.readline())
        alive = cpu.snapshot()  # the child still runs: counted from its own times, not yet reaped
        assert cpu.spent(after, alive) >= own * 0.95
    finally:
        proc.communicate("")


_BURNER = textwrap.dedent("""
    import queue, sys, threading, time
    jobs, done = queue.Queue(), queue.Queue()
    def worker():  # one thread that lives on, as a writer process's IO threads do
        while True:
            seconds = jobs.get()
            t = time.thread_time()
            while time.thread_time() - t < seconds:
                pass
            done.put(time.thread_time() - t)
    threading.Thread(target=worker, daemon=True).start()
    for line in sys.stdin:
        jobs.put(float(line))
        print(done.get(), flush=True)
""")


def test_a_live_helpers_cpu_is_counted_to_the_millisecond_not_the_tick() -> None:
    """A writer process spends ~10 ms on a 256 MiB save: its own clock ticks (10 ms) cannot count that;
    its threads' exact run times can."""
    proc = subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("0.001\n")
        proc.stdin.flush()
        proc.stdout.readline()  # started and settled
        cpu.snapshot()  # psutil imported: not in the windows below
        for seconds in (0.013, 0.027):
            before = cpu.snapshot()
            proc.stdin.write(f"{seconds}\n")
            proc.stdin.flush()
            burnt = float(proc.stdout.readline())
            after = cpu.snapshot()
            assert after.live and all(u.threads is not None for u in after.live.values())
            # Plus this process's look at its children (~2 ms) and the burner's main loop: under a tick.
            assert burnt <= cpu.spent(before, after) <= burnt + 0.006
    finally:
        proc.communicate("")


_PIN_PROBE = textwrap.dedent("""
    import json, os, subprocess, sys, threading
    from ckptio.bench import pinning
    cores = pinning.plan()
    early = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pinning.pin_all(cores)
    go, ids = threading.Event(), []
    def worker():
        ids.append(threading.get_native_id()); go.wait()
    with pinning.training_core(cores):
        t = threading.Thread(target=worker); t.start()  # started inside: inherits the training core...
        while not ids: pass
        me = os.sched_getaffinity(threading.get_native_id())
    late = os.sched_getaffinity(ids[0])
    with pinning.training_core(cores):  # ...until the next window sweeps it to the rest
        swept = os.sched_getaffinity(ids[0])
    after = os.sched_getaffinity(threading.get_native_id())
    go.set(); t.join()
    child = os.sched_getaffinity(early.pid)
    early.communicate(b"")
    print(json.dumps({"cores": cores.to_json(), "me": sorted(me), "late": sorted(late),
                      "swept": sorted(swept), "after": sorted(after), "child": sorted(child)}))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 cores")
def test_pinning_puts_the_step_thread_alone_and_everything_else_on_the_rest() -> None:
    # In a child process: affinity changes would otherwise stay with the test runner's threads.
    out = subprocess.run([sys.executable, "-c", _PIN_PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    train, rest = got["cores"]["train"], got["cores"]["rest"]
    assert not set(train) & set(rest)
    assert got["me"] == train and got["after"] == rest
    assert got["swept"] == rest and got["child"] == rest
    assert got["late"] == train  # what the sweep at each window's start is for


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 cores")
def test_train_pin_reports_the_step_figures_and_the_cores(tmp_path: Path) -> None:
    result = _run(tmp_path, "ckptio", StateSpec(8 << 20, 4), train=True, pin=True)
    assert result["pinned"]["train"] and result["pinned"]["rest"]
    assert "train_slowdown" in result["summary"] and "save_cpu_s_per_gib" in result["summary"]
    assert "train_slowdown_on_core" in result["summary"]
    for s in result["samples"]:
        assert s["train_steps"] >= 1 and s["save_cpu_s"] >= 0


def test_pin_needs_train(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pin", "--cases", "raw-disk", "--no-progress"]) == 2
    assert "--train" in capsys.readouterr().err
    assert main(["--train-window", "2", "--cases", "raw-disk", "--no-progress"]) == 2
    assert "--train-window" in capsys.readouterr().err
    assert main(["--train", "--train-window", "0", "--cases", "raw-disk", "--no-progress"]) == 2
    assert "--train-window" in capsys.readouterr().err


def test_the_json_says_memory_state_and_pinning(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    rc = main(["--cases", "raw-direct,ckptio", "--size", "4MiB", "--rounds", "1", "--dir", str(tmp_path / "w"),
               "--no-progress", "--json", str(out), "--no-equalize"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["memory_state"] == "as-is" and doc["config"]["pin"] is None
    judged = {(g["case"], g["figure"], g["vs"]): g for g in doc["goals"] if g["met"] is not None}
    assert ("ckptio", "save_gibps", "raw-direct") in judged
    assert ("ckptio", "save_cpu_s_per_gib", "cpu-floor") in judged
    assert ("ckptio", "restore_cpu_s_per_gib", "cpu-floor") in judged


def test_slowdown_on_core_leaves_out_waits_for_a_core_only() -> None:
    """A step that waits a fifth of its wall for a core (a neighbour) and nothing else: 1.25x,
    1.0x on core; the same plus GIL waits worth a fifth of its CPU: both count those."""
    from ckptio.bench import train

    idle = {"train_idle_s": 1e-3, "train_idle_cpu_s": 1e-3, "train_idle_runq_s": 0.0}
    queued = {**idle, "train_busy_s": 1.25e-3, "train_cpu_s": 1e-3, "train_runq_s": 0.25e-3, "train_steps": 10}
    assert train.slowdown(queued) == pytest.approx(1.25)
    assert train.slowdown_on_core(queued) == pytest.approx(1.0)
    gil = {**queued, "train_busy_s": 1.45e-3}
    assert train.slowdown_on_core(gil) == pytest.approx(1.2)
    assert train.slowdown_on_core({**idle, "train_busy_s": 1e-3, "train_cpu_s": 1e-3}) is None  # no runq: older JSON


def test_warmup_rounds_run_first_and_stay_out_of_the_medians(tmp_path: Path) -> None:
    """``--warmup``: the first save (staging buffers allocated, libraries imported) is reported apart,
    not as one of the rounds a median is taken over."""
    result = _run(tmp_path, "ckptio", warmup=1)
    assert [s["round"] for s in result["samples"]] == [0, 1, 2]
    assert [bool(s.get("warmup")) for s in result["samples"]] == [True, False, False]
    assert all(s["verified"] for s in result["samples"])  # the warm-up round is checked like the others
    summary = result["summary"]
    assert summary["save_gibps"]["n"] == 2 and summary["restore_gibps"]["n"] == 2
    timed = sorted(ODD.total_bytes / 2**30 / s["save_s"] for s in result["samples"][1:])
    assert summary["save_gibps"]["min"] == pytest.approx(timed[0]) and summary["save_gibps"]["max"] == pytest.approx(timed[1])
    first = result["warmup"]
    assert len(first) == 1 and first[0]["save_gibps"] == pytest.approx(ODD.total_bytes / 2**30 / result["samples"][0]["save_s"])


def test_the_cli_says_how_many_warmup_rounds_ran_and_shows_them_apart(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    rc = main(["--cases", "raw-direct", "--size", "2MiB", "--rounds", "1", "--warmup", "1", "--dir",
               str(tmp_path / "w"), "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "1 rounds after 1 warm-up round" in text and "warm-up round (first save and restore" in text
    doc = json.loads(out.read_text())
    assert doc["config"]["warmup"] == 1
    # The host's huge-page policies, which the writer process's request sizes depend on.
    assert set(doc["env"]["transparent_hugepage"]) == {"enabled", "shmem_enabled"}
    (case,) = doc["cases"]
    assert [s.get("warmup", False) for s in case["samples"]] == [True, False]
    assert case["summary"]["save_gibps"]["n"] == 1


def test_a_negative_warmup_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--cases", "raw-direct", "--size", "2MiB", "--warmup", "-1", "--dir", str(tmp_path), "--no-progress"])
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert "--warmup" in err and len(err.splitlines()) == 1


def test_a_bad_switch_interval_setting_stops_the_bench_before_any_case(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """From the flag or from the environment: one line naming it, no case run (every save would refuse)."""
    monkeypatch.setenv("CKPTIO_GIL_SWITCH_S", "fast")
    assert main(["--cases", "ckptio", "--size", "1MiB", "--rounds", "1", "--dir", str(tmp_path),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "CKPTIO_GIL_SWITCH_S" in err and "fast" in err
    monkeypatch.delenv("CKPTIO_GIL_SWITCH_S")
    assert main(["--cases", "ckptio", "--gil-switch", "-1", "--size", "1MiB", "--rounds", "1",
                 "--dir", str(tmp_path), "--no-progress"]) == 2
    assert "CKPTIO_GIL_SWITCH_S" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no case made its directory
