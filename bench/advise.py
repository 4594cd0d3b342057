"""``--advise --mtbf 4h``: the checkpoint interval and goodput loss each case's measured cost implies.

Young/Daly: with checkpoint cost ``C`` (training time lost per checkpoint)
and mean time between failures ``M``, the best interval is
``τ = sqrt(2·C·M)`` and the expected fraction of time lost is
``C/τ + τ/(2·M)`` (checkpoint overhead plus, on average, half an interval
of recomputation per failure); at the optimum that is ``sqrt(2·C/M)``.

Which cost: for a synchronous save training waits for the whole save, so
``C`` is the save time. For an asynchronous one training only waits for the
stall, so ``C`` is the stall — provided the previous save has finished when
the next one starts, i.e. ``τ ≥ save time``; where Young/Daly asks for a
shorter interval than that, τ is clamped to the save time ("write-bound").
Two costs the formula leaves out are shown beside it, per failure: the
restore (``R/M``), and for async saves the durability lag (a checkpoint
protects nothing until it is durable, ``(save − stall)/M`` more lost work).
Neither counts the background write's competition with training for CPU,
memory bandwidth and the GIL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TextIO

from ckptio.bench.report import fmt_num, print_table

__all__ = ["advise", "render_advice", "young_daly"]


def young_daly(cost_s: float, mtbf_s: float) -> tuple[float, float]:
    """(interval τ in seconds, expected goodput loss fraction) for cost ``C`` and MTBF ``M``."""
    if cost_s <= 0:
        return 0.0, 0.0
    tau = math.sqrt(2.0 * cost_s * mtbf_s)
    return tau, cost_s / tau + tau / (2.0 * mtbf_s)


def _fmt_duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def advise(results: Sequence[dict[str, Any]], mtbf_s: float) -> list[dict[str, Any]]:
    """One entry per successful case with a save figure."""
    out: list[dict[str, Any]] = []
    for r in results:
        s = r.get("summary", {})
        if r.get("status") != "ok" or "save_s" not in s or r.get("kind") == "floor":
            continue
        save_s, stall_s = s["save_s"]["median"], s.get("stall_s", s["save_s"])["median"]
        is_async = any(x.get("async_save") for x in r.get("samples", []))
        cost = stall_s if is_async else save_s
        tau, loss = young_daly(cost, mtbf_s)
        bound = "young-daly"
        if is_async and tau < save_s:
            tau, bound = save_s, "write-bound"
            loss = cost / tau + tau / (2.0 * mtbf_s)
        restore = s.get("restore_s", {}).get("median")
        out.append({
            "case": r["case"], "kind": r.get("kind"), "mode": "async" if is_async else "sync",
            "cost_s": cost, "save_s": save_s, "interval_s": tau, "interval_from": bound,
            "goodput_loss": loss,
            "restore_loss": None if restore is None else restore / mtbf_s,
            "lag_loss": (save_s - stall_s) / mtbf_s if is_async else 0.0,
            "mtbf_s": mtbf_s,
        })
    ref = next((a for a in out if a["case"] == "ckptio"), None)
    for a in out:
        a["loss_vs_ckptio"] = a["goodput_loss"] / ref["goodput_loss"] if ref and ref["goodput_loss"] else None
    return out


def render_advice(advice: Sequence[dict[str, Any]], mtbf_s: float, out: TextIO | None = None) -> None:
    def pct(x: float | None) -> str:
        return "—" if x is None else f"{100 * x:.3g} %"

    rows = [[
        a["case"], a["mode"], fmt_num(a["cost_s"]),
        _fmt_duration(a["interval_s"]) + (" (write-bound)" if a["interval_from"] == "write-bound" else ""),
        pct(a["goodput_loss"]), pct(a["restore_loss"]), pct(a["lag_loss"]),
        "—" if a["loss_vs_ckptio"] is None else f"{a['loss_vs_ckptio']:.2f}×",
    ] for a in advice]
    print_table(
        f"checkpoint interval advice, MTBF {_fmt_duration(mtbf_s)} (Young/Daly τ = sqrt(2·C·MTBF))",
        ["case", "save", "cost C s", "interval τ", "loss C/τ+τ/2M", "+restore/failure",
         "+durability lag", "loss ÷ ckptio"],
        rows,
        ["C = stall for async saves, full save time for sync ones; loss is the fraction of wall clock.",
         "+restore: restore time / MTBF; +durability lag: (save − stall) / MTBF, async only."],
        out,
    )
