"""The fast tier's commit on every host: what stands in each host's own fast tier once a save committed.

The core save commits the job's manifest in host 0's fast tier only (the fast tier is host-local).
:func:`commit_everywhere` then makes the step stand on every other host, each with its own part
only (issue #33 item 1: per save, O(its own part) per host and O(hosts) in total):

1. host 0 reads the manifest it just committed and cuts it into every host's part, a version 2
   commit record (:func:`ckptio.tiers.held.part_records`: the checkpoint id, the number of hosts,
   each own object's key, least size, extents and index in the manifest);
2. host 0 sends each other host its own record, and only that (two point-to-point exchanges: an
   8-byte length, then the record; no host receives another's part, nor the manifest);
3. each other host commits its part by that record under a fence of its own
   (:meth:`ckptio.store.parts.Parts.commit`: objects checked, record written, fence claimed), with no
   manifest in its fast tier; host 0 writes its own record beside its manifest.

A restart's scan (:func:`ckptio.tiers.held.read_held`), retention and deletion, gc, the peer and
durable rounds read a non-coordinator's part from its record; a restore takes the manifest from host
0's part (:func:`ckptio.tiers.policy.plan_restore`'s ``manifest_from``) or the durable tier.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct

from ..engine import run_sync
from ..manifest import Manifest
from ..names import held_key, new_id
from ..store import CheckpointStore
from .group import PeerGroup
from ..store.parts import PartRecord, part_from_json
from .held import part_records, write_held

__all__ = ["commit_everywhere"]

log = logging.getLogger("ckptio.tiers")


def commit_everywhere(group: PeerGroup, fast: CheckpointStore, step: int) -> BaseException | None:
    """Collective, after a save of ``step`` committed (the same verdict on every host): make it stand in
    every host's fast tier -- the manifest on host 0, each other host's own part by its record.

    Returns None once this host holds the step, else why not (logged: the host then does not hold
    the step, and a restore plans around it). Raises nothing: every host takes part in the exchanges.
    """
    rank, step_dir = group.rank, str(step)
    m: Manifest | None = None
    records: dict[int, bytes] = {}
    if rank == 0:
        try:
            m = run_sync(fast.read_manifest(step_dir))
            # The fence is a placeholder: each host commits its part under a fence of its own.
            records = {r: p.to_json() for r, p in part_records(m, new_id(), range(1, group.size)).items()}
        except BaseException as e:  # sending nothing fails every other host alike
            log.error("%s: cannot read the manifest just committed: %r", fast.where(step_dir), e)
    error: BaseException | None = None
    try:
        data = _send_parts(group, records) if group.size > 1 else None
        if rank != 0:
            m = None
            run_sync(fast.parts.commit(_own_record(data, step, rank, fast.where(step_dir))))
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


def _send_parts(group: PeerGroup, records: dict[int, bytes]) -> bytes | None:
    """Collective: host 0 sends each other host ``records[host]`` (absent: an empty one); returns this
    host's (None on host 0). Two exchanges whose sizes every receiver knows: the 8-byte length, then
    the record -- so no host receives any length or byte but its own."""
    rank, size = group.rank, group.size
    lengths = {r: [memoryview(struct.pack("<q", len(records.get(r, b""))))] for r in range(1, size)} if rank == 0 else {}
    got = group.exchange(lengths, {} if rank == 0 else {0: [8]})
    n = 0 if rank == 0 else struct.unpack("<q", bytes(got[0]))[0]
    sends = {r: [memoryview(b)] for r, b in records.items() if b} if rank == 0 else {}
    got = group.exchange(sends, {0: [n]} if n > 0 else {})
    return bytes(got[0]) if n > 0 else None


def _own_record(data: bytes | None, step: int, rank: int, where: str) -> PartRecord:
    """This host's part as host 0 sent it, bound to ``step`` and this host, under a fence of its own."""
    if data is None:
        raise RuntimeError(f"{where}: host 0 sent no record of this host's part (it could not read its manifest)")
    try:
        cid = json.loads(data)["checkpoint_id"]
        record = part_from_json(data, held_key(str(step), str(cid), rank))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: host 0's record of host {rank}'s part is not one: {e}") from None
    if record.sizes is None or "extents" not in record.extra:
        raise ValueError(f"{where}: host 0's record of host {rank}'s part lacks its sizes or extents")
    # A fence of this host's own commit: the record must name the fence that stands in this host's step.
    return dataclasses.replace(record, fence=new_id())
