"""The fast tier's commit on every host: what stands in each host's own fast tier once a save committed.

The core save commits the job's manifest in host 0's fast tier only (the fast tier is host-local).
:func:`commit_everywhere` then makes the step stand on every other host: host 0 broadcasts the
manifest it just committed and every other host commits it in its own fast tier; then each host
that holds the step writes its commit record (:mod:`ckptio.tiers.held`), which a restart's scan reads
instead of the manifest. Each host's record names the fence of its own commit (a non-coordinator's
commit has a fence of its own, not host 0's): only that fence stands in its step.

This is the one place that decides what a non-coordinator receives and stores per save. Today it
is the whole manifest (O(hosts) per host; see issue #33 item 1 and ``bench/tiers_scale.py``); the
consumers of a non-coordinator's manifest (retention and deletion, gc, the peer and durable rounds,
``ckptio ls/verify``) still read it. Restore does not: its manifest comes from host 0's part
(:func:`ckptio.tiers.policy.plan_restore`'s ``manifest_from``).
"""

from __future__ import annotations

import dataclasses
import logging

from ..engine import run_sync
from ..manifest import Manifest
from ..names import new_id
from ..store import CheckpointStore
from .group import PeerGroup
from .held import write_held

__all__ = ["commit_everywhere"]

log = logging.getLogger("ckptio.tiers")


def commit_everywhere(group: PeerGroup, fast: CheckpointStore, step: int) -> BaseException | None:
    """Collective, after a save of ``step`` committed (the same verdict on every host): make it stand in
    every host's fast tier, and record it in each host's that holds it.

    Returns None once this host holds the step, else why not (logged: the host then does not hold
    the step, and a restore plans around it). Raises nothing: every host takes part in the broadcast.
    """
    rank, step_dir = group.rank, str(step)
    data: bytes | None = None
    m: Manifest | None = None
    if rank == 0:
        try:
            m = run_sync(fast.read_manifest(step_dir, shards=False))
            data = m.to_json()
        except BaseException as e:  # broadcasting None fails every other host alike
            log.error("%s: cannot read the manifest just committed: %r", fast.where(step_dir), e)
    error: BaseException | None = None
    try:
        data = group.broadcast_bytes(data, 0)
        if rank != 0:
            # A fence of this host's own commit, as the store would give it, but known here: the
            # record must name the fence that stands in this host's step, or it is never trusted.
            m = dataclasses.replace(Manifest.from_json(data, fast.where(step_dir)), fence=new_id())
            run_sync(fast.commit(step_dir, m, m.to_json()))
    except BaseException as e:
        log.error("%s: the fast-tier commit on host %d failed: %r", fast.where(step_dir), rank, e)
        error = e
    if error is None and m is not None:
        try:  # after the commit stood: a restart's scan then reads this, not the manifest
            run_sync(write_held(fast, step, m, rank))
        except Exception as e:  # noqa: BLE001 -- without a record, the scan reads the manifest
            log.warning("%s: cannot write this host's commit record: %r", fast.where(step_dir), e)
    log.info("%s: committed in the fast tier on host %d (held: %s)", fast.where(step_dir), rank, error is None)
    return error
