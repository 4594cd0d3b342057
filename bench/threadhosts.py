"""Several hosts of one job as threads of this process, for saves that need a coordinator.

The tests (``tests/support/hosts.py``) and the bench's throttled case (:mod:`ckptio.bench.throttled`) use it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["on_hosts"]


class _ThreadGroup:
    """``size`` hosts as threads of this process: an all-gather over a barrier, through JSON."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[str] = [""] * size

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)


class _Member:
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_gather(self, obj: Any) -> list[Any]:
        g = self.group
        g._slots[self.rank] = json.dumps(obj)
        g._barrier.wait()
        out = [json.loads(s) for s in g._slots]
        g._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


def on_hosts(n: int, body: Callable[[int, _Member], Any], *, timeout: float = 300.0) -> list[Any]:
    """Run ``body(rank, coordinator)`` on ``n`` simulated hosts at once; re-raise the first failure."""
    group = _ThreadGroup(n, timeout)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def host(rank: int) -> None:
        try:
            results[rank] = body(rank, group.member(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=host, args=(r,), name=f"host-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return results
