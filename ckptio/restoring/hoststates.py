"""Per-host state targets: each host restores its own saved state (:mod:`ckptio.state.perhost`).

A per-host item holds one state per saving host. A restore by as many hosts
gives host ``r`` the state host ``r`` saved; a restore by another number of
hosts is refused, naming the item and both counts, unless the target is a
``ckptio.PerHost`` with ``on_resize`` (which then maps the saved states to
this host) or a stateful object that is not a data pipeline (every host takes
host 0's state: :func:`ckptio.state.perhost.resize_hook`). A stateful target (a data loader) gets its state loaded in place
once every read of the restore is verified.
"""

from __future__ import annotations

from typing import Any

from ckptio.coord.distributed import default_coordinator
from ckptio.manifest.hoststate import HostStateItem
from ckptio.restoring.buffers import Finish
from ckptio.state.perhost import load_state, resize_hook

__all__ = ["host_state_finisher"]


def host_state_finisher(name: str, item: HostStateItem, target: Any, host: tuple[int, int] | None,
                        where: str) -> Finish:
    """How to build the leaf of per-host item ``name`` on host ``host`` = ``(rank, num_hosts)`` (None:
    the default coordinator's). A host-count mismatch without a hook raises here, before any read."""
    if host is None:
        coord = default_coordinator()
        host = (coord.rank, coord.size)
    rank, size = host
    at = f"{where}: item {name!r}"
    saved = item.num_hosts
    hook = resize_hook(target)
    if saved != size and hook is None:
        raise ValueError(
            f"{at}: per-host state saved by {saved} hosts, restored by {size}; each host's state (a data "
            "loader's position) belongs to one host. To map saved states to the new hosts, restore into "
            "ckptio.PerHost(target, on_resize=fn) (fn(saved_states, host, num_hosts) -> state; "
            "ckptio.state.perhost.take_modulo gives host i the state of saved host i mod "
            f"{saved})")

    def finish() -> Any:
        if saved == size:
            state = item.state(rank, at)
        else:
            state = hook([item.state(h, at) for h in range(saved)], rank, size)  # type: ignore[misc]
        return state if target is None else load_state(target, state)

    return finish
