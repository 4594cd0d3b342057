"""``--sweep``: how cost grows with the number of tensors and with the number of processes.

Tensors: the same bytes as 32 big tensors, then 1k, 10k, 100k small ones.
The fixed cost per tensor (planning, metadata, per-object syscalls) is
``(save(N) − save(N₀)) / (N − N₀)`` against the smallest count N₀ of the same
case: it needs no hook inside any library, so it is comparable across them.
Only cases that declare ``sweep_max_tensors ≥ N`` run at N (DCP plans
every item in Python and stops at 10k; the raw disk and ckptio go to 100k).

Processes: the same bytes split over 1, 2, 4 ``torch.distributed`` gloo
processes (each owns every N-th array), for cases that support more than
one process (``max_world > 1``). Save and restore times are the slowest
rank's, RSS the sum of ranks'. ckptio runs its native API in each rank and
coordinates through the process group itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ckptio.bench.cases import Case
from ckptio.bench.report import fmt_cell, fmt_num, print_table
from ckptio.bench.spec import StateSpec, format_bytes

__all__ = ["plan_sweep", "render_sweep", "run_sweep"]

RunFn = Callable[[type[Case], StateSpec, int], dict[str, Any]]


def _entry(result: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**extra, "case": result["case"], "status": result.get("status"), "error": result.get("error"),
            "summary": result.get("summary", {}), "samples": result.get("samples", []),
            "state_bytes": result.get("state_bytes")}


def _per_tensor(entries: list[dict[str, Any]]) -> None:
    """Fixed cost per extra tensor, in µs, against the case's smallest successful count."""
    by_case: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        if e["status"] == "ok":
            by_case.setdefault(e["case"], []).append(e)
    for es in by_case.values():
        base = min(es, key=lambda e: e["count"])
        for e in es:
            for fig in ("save_s", "restore_s", "stall_s"):  # × the smallest count's time (the ≤ 3× goal)
                have, ref = e["summary"].get(fig), base["summary"].get(fig)
                e[f"{fig[:-2]}_ratio"] = have["median"] / ref["median"] if have and ref and ref["median"] else None
            for fig in ("save_s", "restore_s"):
                key = f"per_tensor_{fig[:-2]}_us"
                if e is base or fig not in e["summary"] or fig not in base["summary"]:
                    e[key] = None
                    continue
                extra = e["summary"][fig]["median"] - base["summary"][fig]["median"]
                e[key] = 1e6 * extra / (e["count"] - base["count"])


def plan_sweep(cases: Sequence[type[Case]], counts: Sequence[int], procs: Sequence[int]
               ) -> list[tuple[type[Case], int, int]]:
    """The sweep's jobs as (case, tensor count, processes); process jobs use the base count (0)."""
    plan = [(cls, n, 1) for n in counts for cls in cases if cls.sweep_max_tensors >= n]
    if importlib.util.find_spec("torch") is not None:  # gloo process groups need torch
        plan += [(cls, 0, n) for n in procs for cls in cases if 1 < cls.max_world and n <= cls.max_world]
    return plan


def run_sweep(cases: Sequence[type[Case]], spec: StateSpec, counts: Sequence[int], procs: Sequence[int],
              run: RunFn) -> dict[str, Any]:
    """Run both sweeps for the cases that support them; failures are error entries."""
    tensors: list[dict[str, Any]] = []
    by_procs: list[dict[str, Any]] = []
    for cls, n, world in plan_sweep(cases, counts, procs):
        if world == 1 and n:
            result = run(cls, dataclasses.replace(spec, count=n), 1)
            tensors.append(_entry(result, count=n, tensor_bytes=spec.total_bytes // n))
        else:
            by_procs.append(_entry(run(cls, spec, world), world_size=world))
    _per_tensor(tensors)
    note = "" if importlib.util.find_spec("torch") else "torch is not installed: no gloo group, no process sweep"
    return {"counts": list(counts), "procs": list(procs), "tensors": tensors, "processes": by_procs,
            "processes_note": note}


def _times(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}×"


def render_sweep(sweep: dict[str, Any], out: TextIO | None = None) -> None:
    def err(e: dict[str, Any]) -> str:
        return f"ERROR: {e.get('error') or '?'}"[:120]

    rows = []
    for e in sweep["tensors"]:
        if e["status"] != "ok":
            rows.append([e["case"], str(e["count"]), format_bytes(e["tensor_bytes"]), err(e), "", "", "", "", "", "", ""])
            continue
        s = e["summary"]
        rows.append([e["case"], str(e["count"]), format_bytes(e["tensor_bytes"]),
                     fmt_cell(s.get("save_gibps")), fmt_cell(s.get("restore_gibps")), fmt_cell(s.get("stall_s")),
                     *(_times(e.get(f"{fig}_ratio")) for fig in ("save", "restore", "stall")),
                     fmt_num(e.get("per_tensor_save_us")), fmt_num(e.get("per_tensor_restore_us"))])
    print_table("sweep: same bytes, more tensors",
                ["case", "tensors", "each", "save GiB/s", "restore GiB/s", "stall s", "save ×", "restore ×",
                 "stall ×", "save µs/tensor", "restore µs/tensor"], rows,
                ["×: median time at N ÷ median time at the case's smallest N (the same bytes in fewest tensors)",
                 "µs/tensor: (time at N − time at the smallest N) / extra tensors: the fixed cost per tensor;",
                 "a negative one is run-to-run noise (the smallest N's round was slower): use more --sweep-rounds."],
                out)
    rows = []
    for e in sweep["processes"]:
        if e["status"] != "ok":
            rows.append([e["case"], str(e["world_size"]), err(e), "", "", ""])
            continue
        s = e["summary"]
        rows.append([e["case"], str(e["world_size"]), fmt_cell(s.get("save_gibps")),
                     fmt_cell(s.get("restore_gibps")), fmt_cell(s.get("stall_s")), fmt_cell(s.get("save_rss_mib"))])
    notes = ["times: slowest rank; RSS: sum over ranks"] + ([sweep["processes_note"]] if sweep["processes_note"] else [])
    print_table("sweep: same bytes, more processes (torch.distributed gloo)",
                ["case", "processes", "save GiB/s", "restore GiB/s", "stall s", "save +RSS MiB"], rows, notes, out)
