"""One collective decision per save: every host's record in, one verdict out.

A save ends with a gather of every host's record to the coordinator (rank 0) and
a broadcast of its verdict. Every host must take part in both, whatever went
wrong on it -- a write that failed, a refusal before the save began -- or the
other hosts' collectives for this step pair with this host's next save, and
every later save fails or hangs one step out of phase. :func:`collective_verdict`
is that rule, written once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ckptio.coord.distributed import AllGatherCoordinator, broadcast_from_root, gather_to_root

__all__ = ["Verdict", "collective_verdict", "failed_record", "join_as_failed"]

log = logging.getLogger("ckptio.save")  # a save's collectives: reported as the save's


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the coordinator decided, as every host receives it."""

    ok: bool
    #: Why not (every failed host's error, or the commit's), empty when ``ok``.
    error: str = ""


def failed_record(rank: int, e: BaseException) -> dict[str, Any]:
    """The record a host that failed sends to the gather, naming itself and its error."""
    return {"ok": False, "error": f"host {rank}: {type(e).__name__}: {e}"}


def collective_verdict(
    coord: AllGatherCoordinator, record: dict[str, Any], commit: Callable[[list[dict[str, Any]]], None] | None = None,
) -> Verdict:
    """Send ``record`` to the coordinator and return its verdict, which every host receives.

    ``record`` is ``{"ok": True, ...}`` or ``{"ok": False, "error": str}``. On the
    coordinator, the verdict fails, naming every failed host's error, if any record is
    not ok; else ``commit(records)`` runs there and the verdict is ok unless it raises.

    Every host joins both the gather and the broadcast, even when ``commit`` raises: its
    exception is re-raised on the coordinator only after the broadcast. Traffic is O(H):
    records go to rank 0 only; every host receives just the small verdict.
    """
    records = gather_to_root(coord, record)
    verdict: dict[str, Any] = {"ok": False}
    raised: BaseException | None = None
    if coord.rank == 0:
        assert records is not None
        errors = [r["error"] for r in records if not r["ok"]]
        if errors:
            verdict = {"ok": False, "error": "; ".join(errors)}
        else:
            try:
                if commit is not None:
                    commit(records)
                verdict = {"ok": True}
            except BaseException as e:  # raised below, once every host has its verdict
                verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
                raised = e
    verdict = broadcast_from_root(coord, verdict)
    if raised is not None:
        raise raised
    return Verdict(bool(verdict["ok"]), verdict.get("error", ""))


def join_as_failed(coord: AllGatherCoordinator, error: str, where: str) -> None:
    """Take part in a save's collectives with a failure record, as the save's own thread would.

    A host that refuses a save before its thread starts (bad input, a committed step, an
    unwritable intent) must still join the gather and the verdict: every host then fails
    this step (naming this host's ``error``) and the next one pairs up. Runs on the calling
    thread, before the error reaches the caller; a failure to report is logged, not raised
    (the caller's own error is the one to raise).
    """
    if coord.size == 1:
        return
    try:
        collective_verdict(coord, {"ok": False, "error": error})
    except BaseException as e:
        log.error("%s: host %d could not report its refusal to the other hosts: %r", where, coord.rank, e)
