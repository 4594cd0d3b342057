"""Best-N retention: a step's metrics, kept in its manifest, and the ranking of steps by them.

The metrics go in the root manifest's user metadata under :data:`METRICS_KEY`: retention
reads root manifests anyway, so a restarted job ranks every old step without reading a
byte of its data, and the metrics commit atomically with the step they describe.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from ckptio.manifest import Manifest

__all__ = ["METRICS_KEY", "BestMode", "BestN", "Metric", "metrics_of", "with_metrics"]

log = logging.getLogger("ckptio.manager")

#: Where a step's metrics live in its manifest's metadata (reserved: user metadata may not use it).
METRICS_KEY = "ckptio.metrics"

BestMode = Literal["min", "max"]
Metric = int | float | str


def with_metrics(
    metadata: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None, best_fn: Callable[[Any], float] | None
) -> dict[str, Any] | None:
    """``metadata`` with ``metrics`` under :data:`METRICS_KEY`, checked before anything is written.

    Metrics must be a mapping of string keys to ints, finite floats (numpy scalars are
    converted) or strings: what the manifest's JSON holds exactly. A bad one raises
    TypeError / ValueError naming its key, and so does a ``best_fn`` that cannot score
    them: both are the caller's mistakes, which no later save would fix.
    """
    if metadata is not None and METRICS_KEY in metadata:
        raise ValueError(f"metadata key {METRICS_KEY!r} is reserved for save(..., metrics=...)")
    if metrics is None:
        return None if metadata is None else dict(metadata)
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers or strings, got {type(metrics).__name__}")
    checked = {_metric_name(k): _metric(k, v) for k, v in metrics.items()}
    if best_fn is not None:
        _score(best_fn, checked, "these metrics")
    return {**(metadata or {}), METRICS_KEY: checked}


def _metric_name(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"metrics: key {key!r} is not a string")
    return key


def _metric(key: str, value: Any) -> Metric:
    # bool is an int to Python but not a number to JSON readers; numpy scalars are what jax and torch
    # metrics usually come as, and convert exactly.
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"metrics[{key!r}] = {value!r}: a bool is not a number (use int({value!r}))")
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, str) or type(value) is int:
        return value
    if isinstance(value, float):
        if not math.isfinite(value):  # a manifest is strict JSON: no NaN, no infinity
            raise ValueError(f"metrics[{key!r}] = {value!r}: not a finite number (a manifest cannot hold it)")
        return float(value)
    raise TypeError(f"metrics[{key!r}] = {value!r} ({type(value).__name__}): metrics are ints, finite floats or "
                    "strings (convert an array with float(x))")


def _score(best_fn: Callable[[Any], float], metrics: Mapping[str, Metric], what: str) -> float:
    score = best_fn(metrics)
    if isinstance(score, (bool, np.bool_)) or not isinstance(score, (int, float, np.integer, np.floating)):
        raise TypeError(f"best_fn({what}) returned {score!r}: it must return a number")
    return float(score)


def metrics_of(manifest: Manifest) -> dict[str, Metric] | None:
    """The metrics a step was saved with (None: saved without; an empty dict counts as without, as in Orbax)."""
    metrics = manifest.metadata.get(METRICS_KEY)
    return metrics if isinstance(metrics, dict) and metrics else None


@dataclasses.dataclass(frozen=True)
class BestN:
    """How best-N retention ranks steps (Orbax's ``best_fn``, ``best_mode`` and
    ``keep_checkpoints_without_metrics``)."""

    fn: Callable[[Mapping[str, Metric]], float]
    mode: BestMode = "min"
    keep_without_metrics: bool = True

    def ranked(self, metrics: Mapping[int, Mapping[str, Metric] | None]) -> list[int]:
        """The steps competing for the best N, best first.

        Steps with metrics rank by ``fn`` (ties: the newer first; a NaN score last). Steps
        without metrics are left out when kept regardless (``keep_without_metrics``), else
        they rank after every scored step, newest first (Orbax's order). A step whose stored
        metrics ``fn`` cannot score (a metric renamed since it was saved) counts as without,
        so that one old step cannot stop retention for good.
        """
        scored: list[tuple[bool, float, int]] = []
        unscored: list[int] = []
        for step, m in metrics.items():
            if m is None:
                unscored.append(step)
                continue
            try:
                score = _score(self.fn, m, f"step {step}'s metrics")
            except Exception as e:  # noqa: BLE001 -- any failure of the user's function on old metrics
                log.warning("best_fn cannot score step %d's metrics %r (%r): it counts as saved without metrics",
                            step, m, e)
                unscored.append(step)
                continue
            better = -score if self.mode == "max" else score
            scored.append((math.isnan(score), 0.0 if math.isnan(score) else better, -step))
        out = [-neg_step for *_, neg_step in sorted(scored)]
        return out if self.keep_without_metrics else out + sorted(unscored, reverse=True)
