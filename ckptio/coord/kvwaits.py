"""Bounded waits on jax's coordination service (the key-value store of ``JaxCoordinator``).

Each wait is under :func:`ckptio.coord.waits.current`'s deadline; on expiry it names the
hosts whose keys never came. Host 0, when a gather times out, leaves an ``abort``
key naming them: a host waiting for host 0's broadcast reads it and fails with
the same message instead of blaming host 0. A host waiting for host 0 waits two
deadlines (host 0 may itself be waiting one for someone else) before it names host 0,
and leaves a ``gone`` key naming itself: host 0, should it come later, fails its next
collective by that instead of waiting for a host that left.
"""

from __future__ import annotations

import time
from typing import Any

from ckptio.coord.waits import CollectiveTimeout, Wait, missing_message

__all__ = ["abort_of", "get_within", "gather_keys", "post_abort", "try_get"]


def try_get(client: Any, key: str) -> str | None:
    """``key``'s value if it is set now (None also for a client without ``key_value_try_get``)."""
    try:
        return client.key_value_try_get(key)  # type: ignore[no-any-return]
    except Exception:  # not found (the service raises), or an older client
        return None


def get_within(client: Any, key: str, wait: Wait, began: float) -> str | None:
    """``key``'s value, or None if it is not set within ``wait.deadline_s`` of ``began``."""
    left = wait.deadline_s - (time.monotonic() - began)
    if left <= 0:
        return try_get(client, key)
    try:
        return client.blocking_key_value_get(key, max(1, int(left * 1000)))  # type: ignore[no-any-return]
    except Exception:  # the service's DEADLINE_EXCEEDED, or a lost connection (raised: not a timeout)
        if time.monotonic() - began < 0.9 * wait.deadline_s:
            raise
        return None


def gather_keys(client: Any, keys: dict[int, str], wait: Wait) -> dict[int, str]:
    """Every host's key (``{rank: key}``) within the deadline, else CollectiveTimeout naming the
    hosts whose keys never came."""
    began = time.monotonic()
    out: dict[int, str] = {}
    for rank, key in keys.items():
        value = get_within(client, key, wait, began)
        if value is None:
            missing = [r for r, k in keys.items() if r not in out and (r == rank or try_get(client, k) is None)]
            message = missing_message(wait, missing)
            raise CollectiveTimeout(message, hosts=tuple(missing), what=wait.what, deadline_s=wait.deadline_s)
        out[rank] = value
    return out


def post_abort(client: Any, key: str, e: CollectiveTimeout) -> None:
    """Leave ``e`` at ``key`` (``<ranks>:<message>``) for the hosts that will look (best effort): host 0's
    abort for those awaiting its broadcast, a host's ``gone`` for host 0."""
    try:
        client.key_value_set(key, f"{','.join(map(str, e.hosts))}:{e}")
    except Exception:  # already set by an earlier abort: that one stands
        pass


def abort_of(client: Any, key: str, wait: Wait) -> CollectiveTimeout | None:
    """The error host 0 left at ``key``, if any."""
    value = try_get(client, key)
    if value is None:
        return None
    ranks, message = value.split(":", 1)
    return CollectiveTimeout(f"host 0 says: {message}", hosts=tuple(int(r) for r in ranks.split(",") if r),
                             what=wait.what, deadline_s=wait.deadline_s)
