"""Plain data shared by the parent (CLI) and the worker processes.

Everything here is JSON-serialisable on purpose: a job travels to a worker as
one JSON document and its result comes back the same way, so the worker never
needs the parent's Python objects and a crashed worker cannot take the
parent's state with it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = [
    "FIGURES",
    "Job",
    "StateSpec",
    "format_bytes",
    "parse_duration",
    "parse_size",
]

# The figures every successful case reports, with their unit and which way is better.
# (name, unit, higher_is_better)
FIGURES: tuple[tuple[str, str, bool], ...] = (
    ("save_gibps", "GiB/s", True),
    ("restore_gibps", "GiB/s", True),
    ("stall_s", "s", False),
    ("save_rss_mib", "MiB", False),
    ("restore_rss_mib", "MiB", False),
    ("save_cpu_s_per_gib", "CPU s/GiB", False),
    ("restore_cpu_s_per_gib", "CPU s/GiB", False),
)

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"4M"``, ``"512k"``, ``"1e9"`` -> bytes (bare K/M/G are binary)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 1GiB, 64MiB, 4M)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """``"4h"``, ``"30m"``, ``"1.5d"``, ``"900"`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (try 4h, 30m, 1d, 900s)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def format_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1073741824 -> '1.00 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """The generated state: ``count`` arrays of one dtype, ``total_bytes`` in all."""

    total_bytes: int = 1 << 30
    count: int = 32
    dtype: str = "float32"
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StateSpec:
        return cls(**d)


@dataclasses.dataclass
class Job:
    """One case run in one worker process: ``warmup`` then ``rounds`` of save + cold restore.

    ``root`` is the case's own fresh directory (or URL) on the target storage;
    round ``r`` saves step ``r`` under it (the warm-up rounds come first: rounds
    ``0 .. warmup-1``). ``world_size > 1`` runs the job in that many gloo
    processes, each owning every ``world_size``-th array.
    """

    case: str
    root: str
    state: StateSpec
    rounds: int = 3
    #: Rounds run first and left out of the medians: their samples say ``"warmup": true`` and the
    #: report shows them apart (``ckptio bench --warmup``; see :attr:`total_rounds`).
    warmup: int = 0
    cache_drop: str = "fadvise"  # "drop_caches" | "fadvise" | "none"
    verify: bool = True
    world_size: int = 1
    #: Run training steps while each asynchronous save finishes (see bench/train.py).
    train: bool = False
    #: With ``train``: the stepping thread alone on one core, the rest of the case on the others
    #: (``--pin``, see bench/pinning.py).
    pin: bool = False
    #: With ``train``: keep stepping until this many seconds from each save's start, and report the
    #: step's figures over that window too (``--train-window``, see bench/train.py ``during``).
    train_window_s: float | None = None
    #: Touch and free as much memory as a restore will fill before each timed restore, so every
    #: case starts from the same memory state (``--no-equalize``: off; see system.equalize_memory).
    equalize: bool = True
    #: Wait for a line on stdin before each round (``ckptio bench --interleave``: the harness
    #: lets one job's round run at a time, in turn, see :func:`bench.harness.run_interleaved`).
    gated: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total_rounds(self) -> int:
        """The rounds the worker runs: the warm-up ones, then the timed ones."""
        return self.warmup + self.rounds

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["state"] = self.state.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Job:
        d = dict(d)
        d["state"] = StateSpec.from_json(d["state"])
        return cls(**d)
