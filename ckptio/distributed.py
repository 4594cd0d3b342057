"""Coordination across hosts, borrowed from the framework that is already running.

A save needs only an all-gather of small JSON-able records (each host's
written objects) and the coordinator's verdict; ckptio takes both from
``torch.distributed`` or ``jax.distributed`` and never runs a cluster runtime
of its own. A single process needs none.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, Protocol

__all__ = ["Coordinator", "JaxCoordinator", "SingleProcess", "TorchCoordinator", "default_coordinator"]


class Coordinator(Protocol):
    """What a save needs from the cluster. ``rank`` 0 is the coordinator that commits."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every host's JSON-able ``obj``, in rank order. May run off the main thread."""
        ...


class SingleProcess:
    rank = 0
    size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


class _Ranked:
    """``rank`` and ``size`` of a coordinator that learned them at construction."""

    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size


class TorchCoordinator(_Ranked):
    """torch.distributed: a dedicated gloo group, so background collectives never
    interleave with the training step's collectives on the default group.

    Construct it on every rank at the same point (creating a group is collective).
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        self._lock = threading.Lock()

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        with self._lock:  # one collective at a time on the group, whatever thread calls
            self._dist.all_gather_object(out, json.dumps(obj), group=self.group)
        return [json.loads(o) for o in out]


class JaxCoordinator(_Ranked):
    """jax.distributed: the coordination service's key-value store and barriers."""

    def __init__(self, prefix: str = "ckptio") -> None:
        import jax
        from jax._src import distributed

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("jax.distributed is not initialized")
        self._rank = jax.process_index()
        self._size = jax.process_count()
        self._prefix = prefix
        self._n = 0
        self._mine: list[str] = []
        self._lock = threading.Lock()

    def all_gather(self, obj: Any, timeout_ms: int = 3_600_000) -> list[Any]:
        with self._lock:
            self._n += 1
            key = f"{self._prefix}/gather/{self._n}"
        self._client.key_value_set(f"{key}/{self._rank}", json.dumps(obj))
        out = [json.loads(self._client.blocking_key_value_get(f"{key}/{r}", timeout_ms)) for r in range(self._size)]
        # The coordination service keeps keys forever. Our key of two gathers ago is safe to
        # drop: every host set its key of the last gather, so it finished reading that one.
        self._mine.append(f"{key}/{self._rank}")
        if len(self._mine) > 2:
            try:
                self._client.key_value_delete(self._mine.pop(0))
            except Exception:  # an older jax without deletes: keep the key, lose nothing
                pass
        return out


_default: Coordinator | None = None


def default_coordinator() -> Coordinator:
    """torch.distributed if initialized, else jax.distributed if initialized, else a single process.

    Frameworks are consulted only if already imported: ckptio never imports them itself.
    """
    global _default
    if _default is not None:
        return _default
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            _default = TorchCoordinator()
            return _default
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            if jax.process_count() > 1:
                _default = JaxCoordinator()
                return _default
        except RuntimeError:
            pass
    return SingleProcess()


def reset_default_coordinator() -> None:
    """Forget the cached coordinator (after a process group is destroyed)."""
    global _default
    _default = None
