"""The fast tier's commit on every host: what stands in each host's own fast tier once a save committed.

The core save commits the job's checkpoint in host 0's fast tier only (the fast tier is host-local),
as format 2 (:mod:`ckptio.saving.carried_fragments`, issue #33): each host sealed its own fragment and sent it with its
boxes in the save's gather; host 0 wrote every fragment as it came and committed a small root built
from the boxes -- it parses no other host's shards. :func:`commit_everywhere` then makes the step stand
on every other host, each with its own part only (per save, O(its own part) per host, O(hosts) in total):

1. host 0 reads its root (small: no fragment) for the checkpoint id and fence, and sends each other
   host two numbers: the checkpoint id and its fragment's *base* (the index in the checkpoint of its
   first object). Two point-to-point exchanges: an 8-byte length, then the message; no host receives
   another's part, nor the manifest;
2. each other host builds its own commit record (version 2: its objects, least sizes, extents, each
   object's index = base + its index in its fragment) from what its save recorded of its own part
   (``SaveHandle.part``) and commits it under a fence of its own
   (:meth:`ckptio.store.parts.Parts.commit`: objects checked, record written, fence claimed), with no
   manifest in its fast tier; host 0 writes its own record beside its root.

A restart's scan (:func:`ckptio.tiers.held.read_held`), retention and deletion, gc, the peer and
durable rounds read a non-coordinator's part from its record; a restore takes the manifest from host
0's part (:func:`ckptio.tiers.policy.plan_restore`'s ``manifest_from``: host 0's fast tier holds the
root and every fragment, its partner's replica a whole format-1 manifest) or the durable tier.
A save without a host's part (one host) falls back to reading host 0's manifest.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from typing import Any

from ckptio.engine import run_sync
from ckptio.manifest.names import new_id
from ckptio.store import CheckpointStore
from ckptio.store.parts import PartRecord
from ckptio.tiers.group import PeerGroup
from ckptio.tiers.held import write_held

__all__ = ["commit_everywhere", "part_record"]

log = logging.getLogger("ckptio.tiers")

_SID = re.compile(r"[0-9a-f]{12}")


def commit_everywhere(group: PeerGroup, fast: CheckpointStore, step: int, part: dict[str, Any] | None = None,
                      bases: list[int] | None = None) -> BaseException | None:
    """Collective, after a save of ``step`` committed (the same verdict on every host): make it stand in
    every host's fast tier -- the root and every fragment on host 0, each other host's own part by its record.

    ``part``: this host's own part as its save recorded it (``SaveHandle.part``); ``bases``: on host 0,
    each host's fragment base (``SaveHandle.part_bases``). Returns None once this host holds the step,
    else why not (logged: the host then does not hold the step, and a restore plans around it). Raises
    nothing: every host takes part in the exchanges.
    """
    rank, step_dir = group.rank, str(step)
    where = fast.where(step_dir)
    if group.size == 1:  # one host: its manifest is the whole checkpoint
        return _write_own_record(fast, step, None, rank, where)
    messages: dict[int, bytes] = {}
    head: tuple[str, str] | None = None
    if rank == 0:
        try:
            root = run_sync(fast.read_manifest(step_dir, shards=False))
            if bases is None or len(bases) != group.size:
                raise RuntimeError("the save recorded no fragment bases (not a save by many hosts?)")
            head = (root.checkpoint_id, root.fence or "")
            messages = {r: json.dumps({"checkpoint_id": root.checkpoint_id, "base": max(bases[r], 0)}).encode()
                        for r in range(1, group.size)}
        except BaseException as e:  # sending nothing fails every other host alike
            log.error("%s: cannot read the root just committed: %r", where, e)
    error: BaseException | None = None
    try:
        data = _send_parts(group, messages)
        if rank != 0:
            cid, base = _checked_message(data, rank, where)
            run_sync(fast.parts.commit(part_record(part, step, cid, rank, group.size, base, new_id(), where)))
    except BaseException as e:
        log.error("%s: the fast-tier commit on host %d failed: %r", where, rank, e)
        error = e
    if rank == 0 and error is None:
        if head is None:
            error = RuntimeError(f"{where}: host 0 could not read its root")
        else:  # after the commit stood: a restart's scan then reads this, not the manifest
            bases = bases or [0]
            error = _write_own_record(fast, step, part_record(part, step, head[0], 0, group.size, max(bases[0], 0),
                                                              head[1], where), 0, where)
    log.info("%s: committed in the fast tier on host %d (held: %s)", where, rank, error is None)
    return error


def part_record(part: dict[str, Any] | None, step: int, checkpoint_id: str, rank: int, num_hosts: int, base: int,
                fence: str, where: str) -> PartRecord:
    """Host ``rank``'s commit record (version 2) of its ``part`` of checkpoint ``checkpoint_id``: each object's
    index in the checkpoint is ``base`` plus its index in the part (its fragment's order)."""
    if part is None:
        raise RuntimeError(f"{where}: host {rank}'s save recorded no part of its own")
    objects = part["objects"]
    return PartRecord(step, checkpoint_id, rank, fence, num_hosts, list(objects), list(part["sizes"]),
                      {"extents": part["extents"], "indices": list(range(base, base + len(objects)))})


def _write_own_record(fast: CheckpointStore, step: int, record: PartRecord | None, rank: int,
                      where: str) -> BaseException | None:
    """This host's record beside its committed manifest (None: cut from the manifest, one host's save)."""
    try:
        if record is None:
            run_sync(write_held(fast, step, run_sync(fast.read_manifest(str(step))), rank))
        else:
            run_sync(fast.io.write(record.key, [memoryview(record.to_json())]))
    except Exception as e:  # noqa: BLE001 -- without a record, the scan reads the manifest
        log.warning("%s: cannot write this host's commit record: %r", where, e)
    return None


def _send_parts(group: PeerGroup, records: dict[int, bytes]) -> bytes | None:
    """Collective: host 0 sends each other host ``records[host]`` (absent: an empty one); returns this
    host's (None on host 0). Two exchanges whose sizes every receiver knows: the 8-byte length, then
    the message -- so no host receives any length or byte but its own."""
    rank, size = group.rank, group.size
    lengths = {r: [memoryview(struct.pack("<q", len(records.get(r, b""))))] for r in range(1, size)} if rank == 0 else {}
    got = group.exchange(lengths, {} if rank == 0 else {0: [8]})
    n = 0 if rank == 0 else struct.unpack("<q", bytes(got[0]))[0]
    sends = {r: [memoryview(b)] for r, b in records.items() if b} if rank == 0 else {}
    got = group.exchange(sends, {0: [n]} if n > 0 else {})
    return bytes(got[0]) if n > 0 else None


def _checked_message(data: bytes | None, rank: int, where: str) -> tuple[str, int]:
    """The checkpoint id and this host's base, as host 0 sent them; an error naming host 0 otherwise."""
    if data is None:
        raise RuntimeError(f"{where}: host 0 sent nothing for host {rank}'s part (it could not read its root)")
    try:
        doc = json.loads(data)
        cid, base = doc["checkpoint_id"], doc["base"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: host 0's message for host {rank}'s part is not one: {e!r}") from None
    if not (isinstance(cid, str) and _SID.fullmatch(cid)) or type(base) is not int or base < 0:
        raise ValueError(f"{where}: host 0's message for host {rank}'s part is not one: {str(doc)[:80]!r}")
    return cid, base
