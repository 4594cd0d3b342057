"""One peer round: each host sends its partner its own part of a step -- its commit record, then its objects.

Each host learns only what it needs: its own part (its record in its fast tier, version 2:
:mod:`ckptio.tiers.held`) and its source's (sent with the objects). No host parses the job's
manifest in a round (that is O(hosts) per host per save, issue #33). Host 0's partner also receives
host 0's manifest: the replica of host 0's part is where a restore reads the manifest when host 0
is lost (:func:`ckptio.tiers.policy.plan_restore`'s ``manifest_from``), so the job's manifest goes to
one host per round, O(hosts) in total. A format-2 checkpoint's goes as stored: host 0 reads its
root (not its fragments) and sends the root's bytes, then every fragment's bytes after its objects,
unparsed; the partner checks each fragment against the root's size and crc32c.

The replica store commits the source's part as its record does in the source's fast tier (a record
+ a fence of the replica's own, :mod:`ckptio.store.parts`); host 0's part with its manifest (a
format-2 root as stored, under its own fence id, once its fragments are written). Then
the marker (``ckptio.replica-of.hNNNNN``) is created, only after the objects are in and checked
against the record's extents -- so a replica is never used half-received -- and the previous
replica is deleted only after the new one is complete.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from ckptio.engine import run_sync
from ckptio.errors import IntegrityError
from ckptio.manifest import FragmentRef, Manifest
from ckptio.manifest.names import held_key, new_id
from ckptio.store import CheckpointStore
from ckptio.store.parts import PartRecord, part_from_json
from ckptio.system.checksum import crc32c, verify_blocks
from ckptio.tiers.group import Message, PeerGroup
from ckptio.tiers.held import own_part_record
from ckptio.tiers.peer import (
    _commit_replica, checkpoint_disagreement, mark_replica, read_chunks, retire_older_replicas,
)
from ckptio.tiers.rootcast import stored_root

__all__ = ["replicate_to_partner"]

log = logging.getLogger("ckptio.tiers.peer")


def own_part(own: CheckpointStore, step: int, rank: int) -> tuple[PartRecord, Manifest | None]:
    """This host's part of ``step`` (its standing record, version 2; else made from the manifest, as a
    record written before version 2 would need), and on host 0 the job's manifest."""
    step_dir = str(step)
    records = [r for r in run_sync(own.parts.standing(step_dir)) if r.host == rank and r.sizes is not None]
    m: Manifest | None = None
    if rank == 0 or len(records) != 1:
        # Host 0 with its record: a format-2 root alone (its fragments go to its partner as stored, unparsed).
        m = run_sync(own.read_manifest(step_dir, shards=len(records) != 1))
    if len(records) == 1 and (m is None or m.checkpoint_id == records[0].checkpoint_id):
        return records[0], m
    assert m is not None
    if not m.complete:  # a record of another checkpoint: this host's part from the whole manifest
        m = run_sync(own.read_manifest(step_dir))
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
    head, sent_error = _head(own, step, mine, m if rank == 0 else None)
    got = group.exchange({partner: [memoryview(json.dumps(head).encode())]} if partner != rank else {})
    error: BaseException | None = sent_error
    theirs: PartRecord | None = None
    job: _JobManifest | None = None
    try:
        doc = json.loads(got[source])
        # Bound to the checkpoint every host agreed on, and to the source: a record of anything else fails.
        theirs = part_from_json(doc["record"].encode(), held_key(str(step), mine.checkpoint_id, source))
        job = _JobManifest.of(doc, replica.where(str(step)))
    except Exception as e:  # noqa: BLE001 -- still take part in the transfer (its messages: none received)
        error = error or e
    mine_root = m if head["root"] and partner != rank else None  # its fragments follow its objects
    error = _transfer(group, own, replica, (mine, mine_root), theirs, job, partner, source, error)
    _finish(group, replica, step, theirs, job, source, partner_offset, error, on_marked)


@dataclasses.dataclass(frozen=True)
class _JobManifest:
    """Host 0's manifest as its partner receives it: a whole one (format 1), or a format-2 root's stored
    bytes (``data``), whose fragments follow the objects, as stored."""

    manifest: Manifest
    data: bytes | None

    @classmethod
    def of(cls, doc: dict[str, Any], where: str) -> _JobManifest | None:
        if doc.get("root"):
            data = base64.b64decode(doc["root"])
            return cls(Manifest.from_json(data, where), data)
        return cls(Manifest.from_json(doc["manifest"].encode(), where), None) if doc.get("manifest") else None

    @property
    def fragments(self) -> list[FragmentRef]:
        return (self.manifest.fragments or []) if self.data is not None else []


def _head(own: CheckpointStore, step: int, mine: PartRecord, m: Manifest | None
          ) -> tuple[dict[str, Any], BaseException | None]:
    """What this host sends its partner first: its record; host 0 also its manifest (a whole one, or a
    format-2 root's stored bytes). An error reading them fails this host's part, after the round."""
    head: dict[str, Any] = {"record": mine.to_json().decode(), "manifest": None, "root": None}
    if m is None:
        return head, None
    try:
        if m.complete:
            head["manifest"] = m.to_json().decode()
        else:
            head["root"] = base64.b64encode(run_sync(stored_root(own, str(step), m))).decode()
    except Exception as e:  # noqa: BLE001 -- this host still takes part in the round
        return head, e
    return head, None


def _transfer(group: PeerGroup, own: CheckpointStore, replica: CheckpointStore,
              sending: tuple[PartRecord, Manifest | None], theirs: PartRecord | None, job: _JobManifest | None,
              partner: int, source: int, error: BaseException | None) -> BaseException | None:
    """Send my objects to my partner (host 0: then its fragments, as stored), receive my source's into the
    replica store (checked)."""
    rank = group.rank
    mine, root = sending
    n_out = len(mine.sizes or [])
    out = [Message((rank, j), rank, partner, n, ("out", j)) for j, n in enumerate(mine.sizes or [])]
    out += [Message((rank, n_out + i), rank, partner, f.size, ("frag-out", i))
            for i, f in enumerate(root.fragments or [] if root is not None else [])]
    inn = ([Message((source, j), source, rank, n, ("in", j)) for j, n in enumerate(theirs.sizes or [])]
           if theirs is not None else [])
    n_in = len(inn)
    inn += [Message((source, n_in + i), source, rank, f.size, ("frag-in", i))
            for i, f in enumerate(job.fragments if job is not None and theirs is not None else [])]
    if theirs is None and error is None:
        error = RuntimeError(f"host {source}'s record did not arrive")

    def provide(msg: Message) -> Iterator[memoryview]:
        kind, j = msg.tag
        key = mine.objects[j] if kind == "out" else (root.fragments or [])[j].key  # type: ignore[union-attr]
        return read_chunks(own, key, msg.nbytes)

    def deliver(msg: Message, buf: bytearray) -> None:
        assert theirs is not None
        kind, j = msg.tag
        if kind == "frag-in":
            assert job is not None
            ref = job.fragments[j]
            if len(buf) != ref.size or crc32c(bytes(buf)) != ref.crc32c:
                raise IntegrityError(f"host {source}'s fragment {ref.key!r} arrived damaged", key=ref.key)
            run_sync(replica.io.write(ref.key, [memoryview(buf)]))
            return
        _check(theirs, j, buf)
        run_sync(replica.io.write(theirs.objects[j], [memoryview(buf)]))

    try:
        group.transfer(out + inn, provide, deliver)
    except BaseException as e:
        error = error or e
    return error


def _finish(group: PeerGroup, replica: CheckpointStore, step: int, theirs: PartRecord | None,
            job: _JobManifest | None, source: int, partner_offset: int, error: BaseException | None,
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
            run_sync(_commit_part_replica(replica, step, theirs, job, source))
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


async def _commit_part_replica(replica: CheckpointStore, step: int, theirs: PartRecord, job: _JobManifest | None,
                               source: int) -> None:
    """Commit the source's part in the replica store (host 0's with its manifest: a format-2 root as stored,
    after its fragments), mark it, retire older ones."""
    await replica.io.sync()
    if job is not None:
        m = job.manifest
        if m.checkpoint_id != theirs.checkpoint_id:
            raise RuntimeError(f"host {source}'s manifest is of checkpoint {m.checkpoint_id}, its record of "
                               f"{theirs.checkpoint_id}")
        await _commit_replica(replica, step, m, source, job.data)
        return
    standing = await replica.parts.standing(str(step))
    if not any(r.host == source and r.checkpoint_id == theirs.checkpoint_id for r in standing):
        # A fence of the replica's own: it decides this copy's commit, not the source's.
        await replica.parts.commit(dataclasses.replace(theirs, fence=new_id()))
    await mark_replica(replica, step, theirs.checkpoint_id, theirs.num_hosts, source)
    await retire_older_replicas(replica, step)
    log.info("replica of host %d, step %d: committed (its record)", source, step)
