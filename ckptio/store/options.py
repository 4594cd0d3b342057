"""How a store is built: one frozen :class:`StoreOptions`, and the step vocabulary every service shares.

Every service of :mod:`ckptio.store` (and every adapter that opens a store:
the DCP writer/reader, the Orbax handler, the managers) takes its root URL,
backend, engine knobs, naming and backend options from one
:class:`StoreOptions`; a variant (another URL, a host-local tier) is
``dataclasses.replace`` of it, never a flipped attribute of a live store.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from contextlib import suppress
from typing import Any

from ckptio.backends import Backend
from ckptio.engine import Engine, EngineConfig
from ckptio.engine.layout import FanoutNaming, FlatNaming, HashedNaming, Naming

__all__ = ["DEFAULT_LEASE_S", "MAX_STEP", "StoreOptions", "check_grace", "default_naming", "step_dir_of"]

#: The largest step a store accepts: the bound ckptio.manifest puts on every integer it records.
MAX_STEP = 1 << 62
#: How long a save's intent stays live without a heartbeat (see ckptio.store.intents).
DEFAULT_LEASE_S = 120.0


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """Everything a :class:`~ckptio.store.CheckpointStore` is built from (picklable without ``backend``/``engine``).

    ``url``: the root; ``backend``: a backend to use instead of opening ``url`` (a wrapper, a
    test double; a store whose backend was handed in cannot be reopened by another process);
    ``engine_config``: the engine's knobs (retries included: the store's own calls are retried
    with the same policy); ``naming``: object naming (None: the backend's default);
    ``backend_options``: keyword options to open the backend with; ``host_local``: each host sees
    only its own objects here (a host-local fast tier), so a commit checks none of them;
    ``engine``: an engine to use instead of a fresh one over the backend (a tier's routed
    restore); ``lease_s``: how long an intent stays live without a heartbeat (None: the
    ``CKPTIO_LEASE_S`` environment variable, else :data:`DEFAULT_LEASE_S`).
    """

    url: str
    backend: Backend | None = None
    engine_config: EngineConfig | None = None
    naming: Naming | None = None
    backend_options: Mapping[str, Any] | None = None
    host_local: bool = False
    engine: Engine | None = None
    lease_s: float | None = None

    def __post_init__(self) -> None:
        raw = os.fspath(self.url)
        if not raw.strip():
            raise ValueError("the checkpoint URL is empty (give a path or a URL such as gs://bucket/run)")
        object.__setattr__(self, "url", raw.rstrip("/") or "/")

    def at(self, url: str | os.PathLike[str]) -> StoreOptions:
        """These options for another root: the backend is opened from ``url`` (same backend options)."""
        return dataclasses.replace(self, url=os.fspath(url), backend=None, engine=None)

    def resolved_lease_s(self) -> float:
        """The lease in seconds (see the class docstring)."""
        if self.lease_s is not None:
            return float(self.lease_s)
        return float(os.environ.get("CKPTIO_LEASE_S", DEFAULT_LEASE_S))


def step_dir_of(step: int | None) -> str:
    """The step directory name (relative to the root); ``""`` for a step-less checkpoint."""
    if step is None:
        return ""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, 2**62], got {step!r}")
    return str(step)


def check_grace(grace_seconds: float) -> float:
    """``grace_seconds`` if it is a finite number of seconds >= 0; ValueError otherwise.

    A NaN grace compares false with every age (and slips through ``max``), a negative one
    dooms objects written after the listing began, an infinite one never sweeps an object:
    each is a typo, not a policy.
    """
    if isinstance(grace_seconds, numbers.Real) and not isinstance(grace_seconds, bool):
        with suppress(OverflowError):  # an int past float's range: refused below
            grace = float(grace_seconds)
            if math.isfinite(grace) and grace >= 0:
                return grace
    raise ValueError(f"grace_seconds must be a finite number of seconds >= 0, got {grace_seconds!r:.40}")


def default_naming(backend: Backend) -> Naming:
    """The naming a backend's layout defaults ask for: hashed on object stores, fanned out or flat on POSIX."""
    defaults = backend.layout_defaults
    if defaults.hashed_names:
        return HashedNaming()
    if defaults.dir_fanout > 0:
        return FanoutNaming(defaults.dir_fanout)
    return FlatNaming()
