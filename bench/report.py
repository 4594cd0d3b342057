"""From raw samples to figures: medians with min–max, ratios, goals, terminal tables.

Every figure is computed per sample first (one round's GiB/s), then
summarised, so the min–max spread is of the figure itself, not of its
inputs.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from ckptio.bench import train
from ckptio.bench.spec import FIGURES

__all__ = [
    "GOALS",
    "check_goals",
    "compute_ratios",
    "cpu_floor",
    "fmt_cell",
    "print_table",
    "render_goals",
    "render_main",
    "render_ratios",
    "summarize",
    "verdict_line",
]

GIB = float(1 << 30)
MIB = float(1 << 20)
RAW = "raw-disk"
DIRECT = "raw-direct"  # the device's own limit: O_DIRECT, no checksums (anchors_direct.py)
# The same after a snapshot copy and a crc32c: the device's limit for a checksummed async save, beside
# DIRECT where the disk writes about as fast as memory copies (anchors_direct.RawDirectSnapshot)
SNAPSHOT = "raw-direct-snapshot"
FLOOR = "cpu-floor"  # not a case: one memcpy + one crc32c + raw-direct's own CPU, per GiB (cpu_floor)

# The goals ckptio holds itself to: (case, figure, reference, bound, kind) where kind
# ">=" means case/reference must be at least bound (throughput), "<=" at most (stall).
GOALS: tuple[tuple[str, str, str, float, str], ...] = (
    ("ckptio", "save_gibps", RAW, 0.9, ">="),
    ("ckptio", "save_gibps", "orbax-default", 2.5, ">="),
    ("ckptio", "save_gibps", "dcp", 1.6, ">="),
    ("ckptio", "restore_gibps", RAW, 0.9, ">="),
    ("ckptio", "save_gibps", DIRECT, 0.9, ">="),
    ("ckptio", "restore_gibps", DIRECT, 0.9, ">="),
    ("ckptio-jax", "save_gibps", DIRECT, 0.9, ">="),
    ("ckptio-torch", "save_gibps", DIRECT, 0.9, ">="),
    ("ckptio-jax", "restore_gibps", DIRECT, 0.9, ">="),
    ("ckptio-torch", "restore_gibps", DIRECT, 0.9, ">="),
    ("ckptio", "save_gibps", SNAPSHOT, 0.9, ">="),
    ("ckptio-jax", "save_gibps", SNAPSHOT, 0.9, ">="),
    ("ckptio-torch", "save_gibps", SNAPSHOT, 0.9, ">="),
    # CPU per GiB: below the library anchors', within 1.5x of copy + crc32c + the kernel's O_DIRECT path
    ("ckptio", "save_cpu_s_per_gib", FLOOR, 1.5, "<="),
    ("ckptio", "restore_cpu_s_per_gib", FLOOR, 1.5, "<="),
    ("ckptio-orbax", "save_cpu_s_per_gib", "orbax-default", 1.0, "<="),
    ("ckptio-orbax", "restore_cpu_s_per_gib", "orbax-default", 1.0, "<="),
    ("ckptio-dcp", "save_cpu_s_per_gib", "dcp", 1.0, "<="),
    ("ckptio-dcp", "restore_cpu_s_per_gib", "dcp", 1.0, "<="),
    ("ckptio-dcp-async", "save_cpu_s_per_gib", "dcp-async", 1.0, "<="),
    ("ckptio-jax", "stall_s", "orbax-default", 1.0, "<="),
    ("ckptio-torch", "stall_s", "memcpy", 1.0, "<="),
    # ckptio under DCP
    ("ckptio-dcp", "save_gibps", "dcp", 1.5, ">="),
    ("ckptio-dcp", "restore_gibps", "dcp", 1.5, ">="),
    ("ckptio-dcp-async", "stall_s", "memcpy", 1.0, "<="),
    ("ckptio-dcp-async", "stall_s", "dcp-async", 1.0, "<="),
    # ckptio on gs:// against the raw aiohttp ceiling on the same server
    ("ckptio", "save_gibps", "raw-aiohttp", 0.8, ">="),
    ("ckptio", "restore_gibps", "raw-aiohttp", 0.8, ">="),
    # ckptio under Orbax
    ("ckptio-orbax", "save_gibps", "orbax-default", 2.5, ">="),
    ("ckptio-orbax", "save_gibps", "orbax-nocomp", 1.1, ">="),
    ("ckptio-orbax", "restore_gibps", "orbax-default", 2.0, ">="),
    ("ckptio-orbax", "stall_s", "orbax-default", 1.0, "<="),
)

_LABELS = {
    "save_gibps": "save GiB/s",
    "restore_gibps": "restore GiB/s",
    "stall_s": "stall s",
    "save_rss_mib": "save +RSS MiB",
    "restore_rss_mib": "restore +RSS MiB",
    "train_slowdown": "train step ×",
    "train_slowdown_on_core": "train step × on core",
    "train_blocked_ms": "train blocked ms",
    "train_lost_ms": "train lost ms/save",
    "train_window_slowdown": "train step × window",
    "train_window_slowdown_on_core": "train step × window on core",
    "save_cpu_s_per_gib": "save CPU s/GiB",
    "restore_cpu_s_per_gib": "restore CPU s/GiB",
}


def _per_sample(sample: Mapping[str, Any], nbytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if sample.get("save_s"):
        out["save_s"] = sample["save_s"]
        out["save_gibps"] = nbytes / GIB / sample["save_s"]
    if sample.get("stall_s") is not None:
        out["stall_s"] = sample["stall_s"]
    if sample.get("restore_s"):
        out["restore_s"] = sample["restore_s"]
        out["restore_gibps"] = nbytes / GIB / sample["restore_s"]
    if (x := train.slowdown(sample)) is not None:
        out["train_slowdown"] = x
        out["train_slowdown_wall"] = sample["train_busy_s"] / sample["train_idle_s"]
        out["train_lost_ms"] = train.lost_s(sample) * 1e3  # type: ignore[operator]
    if (x := train.slowdown_on_core(sample)) is not None:
        out["train_slowdown_on_core"] = x
    if sample.get("train_blocked_s") is not None:
        out["train_blocked_ms"] = sample["train_blocked_s"] * 1e3
    if (window := train.windowed(sample)) is not None and (x := train.slowdown(window)) is not None:
        out["train_window_slowdown"] = x
        out["train_window_lost_ms"] = train.lost_s(window) * 1e3  # type: ignore[operator]
        if (x := train.slowdown_on_core(window)) is not None:
            out["train_window_slowdown_on_core"] = x
    gib = nbytes / GIB
    for key, fig in (("save_cpu_s", "save_cpu_s_per_gib"), ("restore_cpu_s", "restore_cpu_s_per_gib")):
        if sample.get(key) is not None and gib:
            out[fig] = sample[key] / gib
    for key, fig in (("save_rss_bytes", "save_rss_mib"), ("restore_rss_bytes", "restore_rss_mib"),
                     ("save_held_bytes", "save_held_mib")):
        if sample.get(key) is not None:
            out[fig] = sample[key] / MIB
    return out


def summarize(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{figure: {median, min, max, n}}`` over the result's timed samples; stored as ``result["summary"]``.

    Warm-up samples (``"warmup": true``, ``ckptio bench --warmup``) are left out of it; their figures
    go to ``result["warmup"]``, one dict per warm-up round, shown apart by :func:`render_main`."""
    nbytes = int(result.get("state_bytes") or 0)
    samples = result.get("samples", [])
    result["warmup"] = [_per_sample(s, nbytes) for s in samples if s.get("warmup")]
    per = [_per_sample(s, nbytes) for s in samples if not s.get("warmup")]
    summary: dict[str, dict[str, float]] = {}
    for fig in sorted({k for p in per for k in p}):
        vals = [p[fig] for p in per if fig in p]
        summary[fig] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
    result["summary"] = summary
    return summary


def _median(result: Mapping[str, Any] | None, fig: str) -> float | None:
    if not result or result.get("status") != "ok":
        return None
    s = result.get("summary", {}).get(fig)
    return None if s is None else float(s["median"])


def compute_ratios(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``ratios[case][ref][figure] = median(case) / median(ref)`` for every ok pair."""
    ok = [r for r in results if r.get("status") == "ok"]
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for a in ok:
        row: dict[str, dict[str, float | None]] = {}
        for b in ok:
            if a is b:
                continue
            cells: dict[str, float | None] = {}
            for fig, _, _ in FIGURES:
                x, y = _median(a, fig), _median(b, fig)
                cells[fig] = x / y if x is not None and y else None
            row[b["case"]] = cells
        out[a["case"]] = row
    return out


def cpu_floor(results: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The CPU floor per GiB measured in this run, from the ``raw-direct`` case: one memcpy +
    one crc32c (timed on the state, in its ``info``) + its own O_DIRECT write (save) or read
    (restore) CPU per GiB. ``{"save_cpu_s_per_gib": ..., "restore_cpu_s_per_gib": ...}``;
    None when raw-direct did not run."""
    direct = next((r for r in results if r["case"] == DIRECT and r.get("status") == "ok"), None)
    info = (direct or {}).get("info") or {}
    if "floor_copy_cpu_s_per_gib" not in info:
        return None
    staged = info["floor_copy_cpu_s_per_gib"] + info["floor_crc32c_cpu_s_per_gib"]
    out = {}
    for fig in ("save_cpu_s_per_gib", "restore_cpu_s_per_gib"):
        own = _median(direct, fig)
        if own is not None:
            out[fig] = staged + own
    return out


def check_goals(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal with its measured ratio and verdict (None when a side did not run)."""
    by = {r["case"]: r for r in results}
    floor = cpu_floor(results) or {}
    out = []
    for case, fig, ref, bound, kind in GOALS:
        x = _median(by.get(case), fig)
        y = floor.get(fig) if ref == FLOOR else _median(by.get(ref), fig)
        ratio = x / y if x is not None and y else None
        met = None if ratio is None else (ratio >= bound if kind == ">=" else ratio <= bound)
        out.append({"case": case, "figure": fig, "vs": ref, "goal": f"{kind} {bound}", "ratio": ratio, "met": met})
    return out


def fmt_num(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 0.1:
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return f"{x:.2g}"


def fmt_cell(s: Mapping[str, float] | None) -> str:
    """``median (min–max)``; just the median for one sample."""
    if not s:
        return "—"
    if s.get("n", 1) <= 1 or s["min"] == s["max"]:
        return fmt_num(s["median"])
    return f"{fmt_num(s['median'])} ({fmt_num(s['min'])}–{fmt_num(s['max'])})"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"  # a 100× smaller stall must not print as 0.00×


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                notes: Sequence[str] = (), out: TextIO | None = None) -> None:
    """A rich table when rich is installed and ``out`` is a terminal-like stream, else plain text."""
    out = out or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left", caption="\n".join(notes) or None,
                      caption_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
        for r in rows:
            table.add_row(*r)
        Console(file=out, width=max(100, min(200, 24 + 22 * len(headers)))).print(table)
        return
    except ImportError:
        pass
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(title, file=out)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)), file=out)
    for n in notes:
        print(n, file=out)
    print(file=out)


def render_main(results: Sequence[dict[str, Any]], skipped: Mapping[str, str], header: str,
                out: TextIO | None = None) -> None:
    """One row per case: every figure as median (min–max), plus save/restore × raw disk."""
    raw = next((r for r in results if r["case"] == RAW and r.get("status") == "ok"), None)
    direct = next((r for r in results if r["case"] == DIRECT and r.get("status") == "ok"), None)
    extra = [f for f in ("train_slowdown", "train_slowdown_on_core", "train_lost_ms", "train_blocked_ms",
                         "train_window_slowdown", "train_window_slowdown_on_core")
             if any(f in r.get("summary", {}) for r in results)]
    headers = ["case", *(_LABELS[f] for f, _, _ in FIGURES), *(_LABELS[f] for f in extra),
               "held MiB", "save ×raw", "restore ×raw", "save ×direct", "restore ×direct"]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append([r["case"], f"ERROR: {r.get('error', '?')}"[:160], *[""] * (len(headers) - 2)])
            continue
        s = r["summary"]
        ratios = []
        for ref in (raw, direct):
            for fig in ("save_gibps", "restore_gibps"):
                x, y = _median(r, fig), _median(ref, fig)
                ratios.append(fmt_ratio(x / y) if x is not None and y else "—")
        rows.append([r["case"], *(fmt_cell(s.get(f)) for f, _, _ in FIGURES), *(fmt_cell(s.get(f)) for f in extra),
                     fmt_cell(s.get("save_held_mib")), *ratios])
    for name, why in skipped.items():
        rows.append([name, f"skipped: {why}", *[""] * (len(headers) - 2)])
    notes = [
        "median (min–max) over rounds. stall: time save() blocks before returning;",
        "+RSS: peak RSS increase over the RSS before the call (restore includes the restored state itself);",
        "held: RSS after the save is durable over the RSS before the first save (buffers kept between saves);",
        "CPU s/GiB: user + system of every thread and process of the case (its helper processes too), per GiB;",
        "×direct: over raw-direct, the device's limit (O_DIRECT, page-aligned buffers, no checksums).",
    ]
    first = [(r["case"], r["warmup"][0]) for r in results if r.get("status") == "ok" and r.get("warmup")]
    if first:
        notes.append("warm-up round (first save and restore: buffers allocated, libraries imported; not in the "
                     "medians), save GiB/s / stall s / restore GiB/s: " + ", ".join(
                         f"{case} {fmt_num(w.get('save_gibps'))} / {fmt_num(w.get('stall_s'))} / "
                         f"{fmt_num(w.get('restore_gibps'))}" for case, w in first))
    floor = cpu_floor(results)
    if floor:
        notes.append("CPU floor (one memcpy + one crc32c + raw-direct's O_DIRECT CPU) per GiB: save "
                     f"{fmt_num(floor.get('save_cpu_s_per_gib'))}, restore {fmt_num(floor.get('restore_cpu_s_per_gib'))}")
    if extra:
        notes.append("train step ×: a GIL-bound host step's wall time per CPU second while the save finishes in "
                     "the background ÷ the same idle (1 = unaffected; wall per CPU cancels the VM's core-speed "
                     "drift; synchronous saves: none, the stall is the cost); train lost ms/save: the step "
                     "thread's time the save cost, over all its steps; train blocked ms: per step, "
                     "the time that thread neither ran nor waited for a core (the GIL, mostly: the save's own share "
                     "of the slowdown on a loaded host); train step × on core: the same without the step's waits "
                     "for a core (with --pin, other processes' doing, not the save's)")
    if "train_window_slowdown" in extra:
        notes.append("train step × window (--train-window): the same over a fixed window from each save's start "
                     "(or to its end, if later), steps after the save included: every case's loss over one "
                     "length of training time, what goodput counts")
    print_table(header, headers, rows, notes, out)


def render_ratios(results: Sequence[dict[str, Any]], ratios: Mapping[str, Any], out: TextIO | None = None) -> None:
    """For each ckptio case: its figures divided by every other case's."""
    mine = [r["case"] for r in results if r.get("kind") == "ckptio" and r.get("status") == "ok"]
    if not mine:
        print_table("ckptio vs anchors", ["ratio"], [["no ckptio case succeeded: no ratios"]], out=out)
        return
    for case in mine:
        rows = [[ref, *(fmt_ratio(cells.get(f)) for f, _, _ in FIGURES)] for ref, cells in ratios[case].items()]
        print_table(f"{case} ÷ each case (throughput: >1 is better; stall, RSS: <1 is better)",
                    ["vs", *(_LABELS[f] for f, _, _ in FIGURES)], rows, out=out)


def verdict_line(goals: Sequence[Mapping[str, Any]], *, check: bool, out: TextIO | None = None) -> int:
    """One line: how many goals this run judged were met and missed; returns the number missed."""
    judged = [g for g in goals if g["met"] is not None]
    missed = [g for g in judged if not g["met"]]
    hint = "" if check or not missed else " (--check exits 1 on a missed goal)"
    names = "; missed: " + ", ".join(f"{g['case']} {_LABELS.get(g['figure'], g['figure'])} vs {g['vs']}"
                                      for g in missed) if missed else ""
    print(f"goals: {len(judged) - len(missed)} of {len(judged)} met{names}{hint}", file=out or sys.stdout)
    return len(missed)


def render_goals(goals: Sequence[Mapping[str, Any]], out: TextIO | None = None) -> None:
    """The goals this run could judge; the others (a side not run) are only counted in a note."""
    rows = []
    for g in goals:
        if g["met"] is None:
            continue
        rows.append([g["case"], _LABELS.get(g["figure"], g["figure"]), g["vs"], g["goal"],
                     fmt_ratio(g["ratio"]), "met" if g["met"] else "MISSED"])
    skipped = len(goals) - len(rows)
    notes = [f"{skipped} more goal(s) need cases this run did not have (all in --json)"] if skipped else []
    print_table("goals: ckptio against the reference on the same storage",
                ["case", "figure", "vs", "goal", "ratio", "verdict"], rows, notes, out=out)
