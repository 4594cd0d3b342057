"""Which steps are saved and which are kept: the save interval and retention, one definition each.

:class:`CheckpointManager` (one store) and the tiered manager (a retention per
tier, one save interval) both use them, so "newest N plus every K-th" and
"every M-th step" mean the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

__all__ = ["Retention", "SaveInterval"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which committed steps a tier keeps: the newest ``max_to_keep`` plus every ``keep_period``-th.

    ``max_to_keep`` None keeps everything. ``keep_period`` steps are kept forever; the newest
    ``max_to_keep`` are counted among all steps, periodic ones included.
    """

    max_to_keep: int | None = None
    keep_period: int | None = None

    def __post_init__(self) -> None:
        if self.max_to_keep is not None and self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
        if self.keep_period is not None and self.keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {self.keep_period}")

    def periodic(self, step: int) -> bool:
        """Whether ``step`` is kept forever by ``keep_period``."""
        return bool(self.keep_period) and step % self.keep_period == 0  # type: ignore[operator]

    def doomed(self, steps: Sequence[int], pinned: Collection[int] = ()) -> list[int]:
        """Steps to delete from ``steps`` (in their order): beyond the newest ``max_to_keep``, unless
        periodic or ``pinned``."""
        if self.max_to_keep is None:
            return []
        newest = set(sorted(steps)[-self.max_to_keep :])
        return [s for s in steps if s not in newest and s not in pinned and not self.periodic(s)]


@dataclasses.dataclass(frozen=True)
class SaveInterval:
    """A save is due every ``every``-th step (multiples of it)."""

    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {self.every}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is on the interval."""
        return step % self.every == 0
