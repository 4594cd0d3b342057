"""One peer round: each host sends its partner its own part of a step -- its commit record, then its objects.

Each host learns only what it needs: its own part (its record in its fast tier, version 2:
:mod:`ckptio.tiers.held`) and its source's (sent with the objects). No host parses the job's
manifest in a round (that is O(hosts) per host per save, issue #33) except host 0, whose partner
also receives host 0's manifest: the replica of host 0's part is where a restore reads the
manifest when host 0 is lost (:func:`ckptio.tiers.policy.plan_restore`'s ``manifest_from``), so the
job's manifest goes to one host per round, O(hosts) in total.

The replica store commits the source's part as its record does in the source's fast tier (a record
+ a fence of the replica's own, :mod:`ckptio.store.parts`); host 0's part with its manifest. Then
the marker (``ckptio.replica-of.hNNNNN``) is created, only after the objects are in and checked
against the record's extents -- so a replica is never used half-received -- and the previous
replica is deleted only after the new one is complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator

from ..checksum import verify_blocks
from ..engine import run_sync
from ..manifest import Manifest
from ..names import held_key, new_id
from ..store import CheckpointStore
from ..store.parts import PartRecord, part_from_json
from .group import Message, PeerGroup
from .held import own_part_record
from .peer import _commit_replica, checkpoint_disagreement, mark_replica, read_chunks, retire_older_replicas

__all__ = ["replicate_to_partner"]

log = logging.getLogger("ckptio.tiers.peer")


def own_part(own: CheckpointStore, step: int, rank: int) -> tuple[PartRecord, Manifest | None]:
    """This host's part of ``step`` (its standing record, version 2; else made from the manifest, as a
    record written before version 2 would need), and on host 0 the job's manifest."""
    step_dir = str(step)
    records = [r for r in run_sync(own.parts.standing(step_dir)) if r.host == rank and r.sizes is not None]
    m: Manifest | None = None
    if rank == 0 or len(records) != 1:
        m = run_sync(own.read_manifest(step_dir))
    if len(records) == 1 and (m is None or m.checkpoint_id == records[0].checkpoint_id):
        return records[0], m
    assert m is not None
    return own_part_record(m, rank, m.fence or ""), m


def _check(record: PartRecord, j: int, buf: bytearray) -> None:
    """The received bytes of the record's ``j``-th object against its extents: never keep a corrupt replica."""
    view = memoryview(buf)
    key = record.objects[j]
    for off, n, crcs, item, block in record.extra["extents"][j]:
        verify_blocks(view[off : off + n], crcs, block, key=key, item=item, start=off)


def replicate_to_partner(
    group: PeerGroup, own: CheckpointStore, replica: CheckpointStore, step: int, partner_offset: int,
    on_marked: Callable[[list[int]], None] | None = None,
) -> None:
    """One round, on every host at once: send my part of ``step`` to my partner, keep my source's.

    Every host must call it for the same step (the replication worker agrees
    on it first). Raises on the hosts whose part failed; the others go on.
    ``on_marked(sources)`` learns, on every host alike (even one whose own
    part failed), the hosts whose replica of ``step`` is marked complete on
    their partner -- the fast tier's retention keeps those hosts' own copies
    of it (see :class:`ckptio.tiers.TieredCheckpointManager`).
    """
    rank, size = group.rank, group.size
    mine: PartRecord | None = None
    m: Manifest | None = None
    try:
        mine, m = own_part(own, step, rank)
    except Exception as e:  # absent or unreadable: this host takes part, and the round fails everywhere
        log.error("peer replication of step %d: %r", step, e)
    # Host 0 alone checks that every host holds the same checkpoint; the others receive its verdict.
    ids = group.gather(mine.checkpoint_id if mine is not None else None)
    disagreement = group.broadcast(checkpoint_disagreement(ids) if ids is not None else None)
    if disagreement is not None or mine is None:
        raise RuntimeError(f"peer replication of step {step}: {disagreement}")
    partner, source = (rank + partner_offset) % size, (rank - partner_offset) % size
    # The record first (and host 0's manifest, to its partner only): the receiver's messages follow from it.
    head = {"record": mine.to_json().decode(), "manifest": m.to_json().decode() if rank == 0 and m else None}
    got = group.exchange({partner: [memoryview(json.dumps(head).encode())]} if partner != rank else {})
    error: BaseException | None = None
    theirs: PartRecord | None = None
    their_manifest: bytes | None = None
    try:
        doc = json.loads(got[source])
        # Bound to the checkpoint every host agreed on, and to the source: a record of anything else fails.
        theirs = part_from_json(doc["record"].encode(), held_key(str(step), mine.checkpoint_id, source))
        their_manifest = doc["manifest"].encode() if doc.get("manifest") else None
    except Exception as e:  # noqa: BLE001 -- still take part in the transfer (its messages: none received)
        error = e
    error = _transfer(group, own, replica, mine, theirs, partner, source, error)
    _finish(group, replica, step, theirs, their_manifest, source, partner_offset, error, on_marked)


def _transfer(group: PeerGroup, own: CheckpointStore, replica: CheckpointStore, mine: PartRecord,
              theirs: PartRecord | None, partner: int, source: int, error: BaseException | None
              ) -> BaseException | None:
    """Send my objects to my partner, receive my source's into the replica store (checked)."""
    rank = group.rank
    out = [Message((rank, j), rank, partner, n, ("out", j)) for j, n in enumerate(mine.sizes or [])]
    inn = ([Message((source, j), source, rank, n, ("in", j)) for j, n in enumerate(theirs.sizes or [])]
           if theirs is not None else [])
    if theirs is None and error is None:
        error = RuntimeError(f"host {source}'s record did not arrive")

    def provide(msg: Message) -> Iterator[memoryview]:
        return read_chunks(own, mine.objects[msg.tag[1]], msg.nbytes)

    def deliver(msg: Message, buf: bytearray) -> None:
        assert theirs is not None
        j = msg.tag[1]
        _check(theirs, j, buf)
        run_sync(replica.io.write(theirs.objects[j], [memoryview(buf)]))

    try:
        group.transfer(out + inn, provide, deliver)
    except BaseException as e:
        error = error or e
    return error


def _finish(group: PeerGroup, replica: CheckpointStore, step: int, theirs: PartRecord | None,
            their_manifest: bytes | None, source: int, partner_offset: int, error: BaseException | None,
            on_marked: Callable[[list[int]], None] | None) -> None:
    """The status rounds: who failed to send, then commit + mark the source's replica, then who marked."""
    size = group.size
    # Each host needs only its source's outcome: host 0 gathers them and broadcasts the hosts that
    # failed (none, normally), so no host receives every host's status.
    oks = group.gather(error is None)
    failed = group.broadcast([r for r, ok in enumerate(oks) if not ok] if oks is not None else None)
    failure: BaseException | None = None
    if source in failed or error is not None or theirs is None:
        failure = RuntimeError(f"peer replication of step {step}: host {source}'s snapshot did not arrive whole")
        failure.__cause__ = error
    else:
        try:
            run_sync(_commit_part_replica(replica, step, theirs, their_manifest, source))
        except BaseException as e:  # still take part in the status round below
            failure = e
    # The replicated-step marker decides: a host's step counts as replicated only once its partner's
    # marker is in. Host 0 gathers who marked and broadcasts the hosts whose replica is not (O(failures)).
    marked = group.gather(failure is None)
    unmarked = group.broadcast([r for r, ok in enumerate(marked) if not ok] if marked is not None else None)
    if on_marked is not None:
        on_marked(sorted({(r - partner_offset) % size for r in range(size)} -
                         {(r - partner_offset) % size for r in unmarked}))
    if failure is not None:
        raise failure


async def _commit_part_replica(replica: CheckpointStore, step: int, theirs: PartRecord, manifest: bytes | None,
                               source: int) -> None:
    """Commit the source's part in the replica store (host 0's with its manifest), mark it, retire older ones."""
    await replica.io.sync()
    if manifest is not None:
        m = Manifest.from_json(manifest, replica.where(str(step)))
        if m.checkpoint_id != theirs.checkpoint_id:
            raise RuntimeError(f"host {source}'s manifest is of checkpoint {m.checkpoint_id}, its record of "
                               f"{theirs.checkpoint_id}")
        await _commit_replica(replica, step, m, source)
        return
    standing = await replica.parts.standing(str(step))
    if not any(r.host == source and r.checkpoint_id == theirs.checkpoint_id for r in standing):
        # A fence of the replica's own: it decides this copy's commit, not the source's.
        await replica.parts.commit(dataclasses.replace(theirs, fence=new_id()))
    await mark_replica(replica, step, theirs.checkpoint_id, theirs.num_hosts, source)
    await retire_older_replicas(replica, step)
    log.info("replica of host %d, step %d: committed (its record)", source, step)
