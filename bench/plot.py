"""``--plot FILE.png``: one bar chart per figure, medians with min–max error bars."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from ckptio.bench.spec import FIGURES

__all__ = ["figure", "plot"]

_TITLES = {
    "save_gibps": "save GiB/s (higher is better)",
    "restore_gibps": "cold restore GiB/s (higher is better)",
    "stall_s": "stall: save() blocks, s (log; lower is better)",
    "save_rss_mib": "peak RSS increase during save, MiB",
    "restore_rss_mib": "peak RSS increase during restore, MiB",
    "save_cpu_s_per_gib": "save CPU s per GiB, every thread and process (lower is better)",
    "restore_cpu_s_per_gib": "restore CPU s per GiB, every thread and process (lower is better)",
}


def _colour(result: dict[str, Any]) -> str:
    return {"ckptio": "tab:red", "floor": "tab:gray"}.get(result.get("kind", ""), "tab:blue")


_TITLE_PT = 11


def plot(path: str, results: Sequence[dict[str, Any]], title: str) -> None:
    """Write a PNG with a panel per figure; cases that failed are left out."""
    import matplotlib.pyplot as plt

    fig = figure(results, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(results: Sequence[dict[str, Any]], title: str) -> Any:
    """The matplotlib figure :func:`plot` writes (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and never pick an interactive backend
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok"]
    figs = [f for f, _, _ in FIGURES]
    fig, axes = plt.subplots(len(figs), 1, figsize=(max(7.0, 0.8 * len(ok) + 2), 3.2 * len(figs)))
    for ax, name in zip(axes, figs):
        # The memcpy floor is no storage: it belongs in the stall and memory panels only.
        rows = [(r["case"], r["summary"][name], _colour(r)) for r in ok
                if name in r.get("summary", {}) and not (name.endswith("gibps") and r.get("kind") == "floor")]
        if not rows:
            ax.set_visible(False)
            continue
        xs = range(len(rows))
        med = [s["median"] for _, s, _ in rows]
        err = [[m - s["min"] for m, (_, s, _) in zip(med, rows)], [s["max"] - m for m, (_, s, _) in zip(med, rows)]]
        ax.bar(xs, med, yerr=err, capsize=4, color=[c for _, _, c in rows])
        ax.set_xticks(list(xs), [n for n, _, _ in rows], rotation=30, ha="right")
        ax.set_title(_TITLES[name], fontsize=10)
        if name == "stall_s" and min(med) > 0:
            ax.set_yscale("log")
        raw = next((s["median"] for n, s, _ in rows if n == "raw-disk"), None)
        if raw is not None and name.endswith("gibps"):
            ax.axhline(raw, ls="--", lw=1, color="black", label="raw disk")
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    # The run's header is longer than the figure is wide: wrap it to the width (about 0.6 em per
    # character) and keep room above the panels for every line, or the title is cut off.
    width_in, height_in = fig.get_size_inches()
    lines = textwrap.wrap(title, width=max(20, int(width_in * 72 / (0.6 * _TITLE_PT)))) or [""]
    fig.suptitle("\n".join(lines), fontsize=_TITLE_PT)
    top = 1 - (len(lines) * 1.5 * _TITLE_PT / 72 + 0.1) / height_in
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig
