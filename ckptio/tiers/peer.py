"""Peer replicas: each host's latest snapshot kept by a partner host, and reads from peers at restore.

A host's fast tier holds, for every committed step, the objects it wrote and
its commit record (:mod:`ckptio.tiers.held`), by which a non-coordinator's
part is committed (:mod:`ckptio.tiers.fastcommit`); host 0's also holds the
job's manifest. Its *replica store*
holds what partners sent in a round (:mod:`ckptio.tiers.peerround`): the
partner's record (host 0's partner: the job's manifest), the partner's
objects under the same keys, and a marker per partner
(``ckptio.replica-of.hNNNNN``, holding the checkpoint id and number of hosts
that a restart's scan needs) created only after that partner's objects
are in -- so a replica is never used half-received. The previous replica is
deleted only after the new one is complete: there is always one to fall
back on.

Bytes travel over a dedicated gloo group (:mod:`ckptio.tiers.group`); the
receiver checks each extent's block checksums before keeping it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ckptio.backends.base import Backend, ByteRange, Capabilities, ObjectInfo, ReadOnlyBackend
from ckptio.coord.distributed import join_errors
from ckptio.engine import gather_or_cancel, run_sync
from ckptio.errors import CheckpointNotFoundError
from ckptio.manage.copying import object_extents, object_writers
from ckptio.manifest import Manifest
from ckptio.manifest.names import parse_replica_mark, replica_mark_key
from ckptio.store import CheckpointStore
from ckptio.system import scatter_bytes
from ckptio.tiers.group import CHUNK, Message, PeerGroup
from ckptio.tiers.held import OwnPart, own_object_keys, read_held
from ckptio.tiers.policy import DURABLE, LOCAL, PEER, Holding, RestorePlan

__all__ = [
    "RoutedBackend",
    "checkpoint_disagreement",
    "fetch_from_peers",
    "holdings",
    "object_sizes",
    "read_chunks",
    "mark_replica",
    "object_host",
    "retire_older_replicas",
    "retire_replica",
]

log = logging.getLogger("ckptio.tiers.peer")

#: The last component of an object's key as every naming of :mod:`ckptio.engine.layout` spells it.
OBJECT_NAME = re.compile(r"(?P<sid>[^./]+)\.h(?P<host>\d{5,})-(?P<n>\d{5,})")


def object_sizes(manifest: Manifest) -> list[int]:
    """Bytes of each object that extents use (what a peer must send; 0 for unreferenced objects)."""
    return [max((e[0] + e[1] for e in ex), default=0) for ex in object_extents(manifest)]


def checkpoint_disagreement(ids: Sequence[str | None], most: int = 8) -> str | None:
    """None if every host's checkpoint id of a step is the same (and not None), else why not, bounded
    (it is broadcast to every host, so it must not grow with the number of hosts)."""
    if ids and ids[0] is not None and all(i == ids[0] for i in ids):
        return None
    others = [r for r, i in enumerate(ids) if i is None or i != ids[0]]
    shown = ", ".join(map(str, others[:most])) + (f", ... ({len(others)} hosts)" if len(others) > most else "")
    return f"not committed in every host's fast tier (host 0: {ids[0] if ids else None!r}; other or none: {shown})"


async def _own_holdings(own: CheckpointStore, rank: int) -> list[Holding]:
    out = []
    for step in await own.committed_steps():
        try:
            # This host's commit record says it in O(its own objects); without one, the whole manifest.
            part = await read_held(own, step, rank)
            if part is None:
                m = await own.read_manifest(str(step))
                part = OwnPart(m.checkpoint_id, m.num_hosts, own_object_keys(m, rank))
                await gather_or_cancel(own.io.stat(k) for k in part.objects)
        except FileNotFoundError:  # deleted meanwhile, or objects lost: not held
            continue
        out.append(Holding(rank, step, part.checkpoint_id, rank, part.num_hosts, True))
    return out


async def _replica_holdings(replica: CheckpointStore, rank: int) -> list[Holding]:
    out = []
    for step in await replica.committed_steps():
        try:
            infos = await replica.io.list(f"{step}/")
        except FileNotFoundError:
            continue
        m: Manifest | None = None
        for info in infos:
            mark = parse_replica_mark(info.key)
            if mark is None or mark.step_dir != str(step):
                continue
            try:
                said = await _mark_says(replica, info.key)
                if said is None:  # an older run's empty marker: the manifest says it
                    m = m or await replica.read_manifest(str(step))
                    said = (m.checkpoint_id, m.num_hosts)
            except FileNotFoundError:
                break
            out.append(Holding(rank, step, said[0], mark.host, said[1], False))
    return out


async def _mark_says(replica: CheckpointStore, key: str) -> tuple[str, int] | None:
    """The checkpoint id and number of hosts a replica marker records; None for one that records none."""
    try:
        doc = json.loads(await replica.io.read(key) or b"null")
        return (doc["checkpoint_id"], doc["num_hosts"]) if isinstance(doc, dict) and isinstance(
            doc.get("checkpoint_id"), str) and isinstance(doc.get("num_hosts"), int) else None
    except (ValueError, UnicodeDecodeError):
        return None


def holdings(own: CheckpointStore, replica: CheckpointStore | None, rank: int) -> list[Holding]:
    """What this host holds in its fast tier: its own complete copies and its partners' replicas."""
    out = run_sync(_own_holdings(own, rank))
    if replica is not None:
        out += run_sync(_replica_holdings(replica, rank))
    return out


def read_chunks(store: CheckpointStore, key: str, nbytes: int, chunk: int = CHUNK) -> Iterator[memoryview]:
    """The first ``nbytes`` of object ``key``, read ``chunk`` bytes at a time as the caller asks
    (unchecked: the receiver checks)."""
    for lo in range(0, nbytes, chunk):
        buf = bytearray(min(chunk, nbytes - lo))
        rng = ByteRange(lo, lo + len(buf))
        view = memoryview(buf)
        run_sync(store.io.read_into(key, rng, [view]))
        yield memoryview(buf)


async def _commit_replica(replica: CheckpointStore, step: int, m: Manifest, source: int,
                          data: bytes | None = None) -> None:
    """Commit ``m`` in the replica store (the replica of ``source``'s part; host 0's, whose partner keeps
    the job's manifest; ``data``: a format-2 root's stored bytes, its fragments already written), mark
    it, retire the older replicas."""
    step_dir = str(step)
    await replica.io.sync()
    try:
        await replica.commit(step_dir, m, data)
    except FileExistsError:  # another partner's replica of the same checkpoint came first
        if (await replica.read_manifest(step_dir, shards=False)).checkpoint_id != m.checkpoint_id:
            raise
    await mark_replica(replica, step, m.checkpoint_id, m.num_hosts, source)
    await retire_older_replicas(replica, step)
    log.info("replica of host %d, step %d: committed", source, step)


async def mark_replica(replica: CheckpointStore, step: int, checkpoint_id: str, num_hosts: int, source: int) -> None:
    """Create ``source``'s marker of ``step``, once its replica is committed: from then on it counts."""
    try:
        # What a restart's scan needs, so that it does not parse the manifest (see _replica_holdings).
        said = json.dumps({"checkpoint_id": checkpoint_id, "num_hosts": num_hosts}).encode()
        await replica.io.create_if_absent(replica_mark_key(str(step), source), said)
    except FileExistsError:
        pass


async def retire_older_replicas(replica: CheckpointStore, step: int) -> None:
    """Only the latest snapshot is kept: older replicas go once the new one is complete."""
    for old in await replica.step_dirs():
        if old < step:
            await retire_replica(replica, old)


async def retire_replica(replica: CheckpointStore, step: int) -> None:
    """Delete a replica step: its markers first (from then on nobody counts on it), then the checkpoint.

    Like every deleter, it deletes only keys :mod:`ckptio.manifest.names` proves are ckptio's: the markers
    :func:`ckptio.manifest.names.parse_replica_mark` parses as this step's (a lookalike such as
    ``ckptio.replica-of.h00001.bak`` stays), then what :meth:`CheckpointStore.delete` deletes.
    """
    step_dir = str(step)
    infos = await replica.io.list(f"{step_dir}/")
    for k in _marks_of(infos, step_dir):
        try:
            await replica.io.delete(k)
        except FileNotFoundError:
            pass
    await replica.delete(step_dir)


def _marks_of(infos: Iterable[ObjectInfo], step_dir: str) -> list[str]:
    """The keys among ``infos`` that are replica markers of ``step_dir``: the only ones to delete as such."""
    return [i.key for i in infos if (m := parse_replica_mark(i.key)) is not None and m.step_dir == step_dir]


def fetch_from_peers(
    group: PeerGroup,
    plan: RestorePlan,
    manifest: Manifest,
    needed: Sequence[int],
    store_for: Callable[[int], CheckpointStore],
    local_error: str | None = None,
) -> dict[str, bytearray]:
    """Collective: every host asks for the objects its plan sources from peers; providers send them.

    ``needed`` are this host's object indices (in its ``manifest``, which may hold only the
    fragments this host loaded) whose source is ``PEER``; ``store_for(writer)`` is this host's
    store holding ``writer``'s objects. An ask names the object by key, so that a provider needs
    no manifest. Returns the received objects by key. Raises on every host if any host's transfer
    failed, or if any host brings a ``local_error`` from preparing its part (a restore must not go
    on half-fed on some hosts).
    """
    messages, bad = _asks(group, plan, manifest, needed)
    got: dict[str, bytearray] = {}

    def provide(msg: Message) -> Iterator[memoryview]:
        writer, key, why = msg.tag
        if why is not None:  # zeros go instead (the transfer keeps the stream aligned)
            raise RuntimeError(f"object {key!r}: {why}")
        return read_chunks(store_for(writer), key, msg.nbytes)

    def deliver(msg: Message, buf: bytearray) -> None:
        got[msg.tag[1]] = buf

    problem = local_error or next(iter(bad), None)
    error = f"host {group.rank}: {problem}" if problem else None
    try:
        group.transfer(messages, provide, deliver)
    except BaseException as e:
        error = f"host {group.rank}: {type(e).__name__}: {e}"
    # Every host must fail alike, but only host 0 needs every host's error to say so.
    errors = group.gather(error)
    verdict = group.broadcast(join_errors([e for e in errors if e]) if errors is not None else None)
    if verdict:
        raise RuntimeError(f"restore of step {plan.step} failed (its plan or its fetch from peers): {verdict}")
    return got


def object_host(key: str) -> int | None:
    """The host a ckptio object's key names in its last component (``sid.hHOST-N``), else None."""
    m = OBJECT_NAME.fullmatch(key.rpartition("/")[2])
    return int(m["host"]) if m is not None else None


def _asks(group: PeerGroup, plan: RestorePlan, manifest: Manifest, needed: Sequence[int]
          ) -> tuple[list[Message], list[str]]:
    """Collective: the messages this host receives (its asks) and sends (what needers ask of it),
    and why any ask of its own is bad.

    Each needer tells only the providers it asks (an exchange: what a host receives grows with
    what is asked of it, plus 8 bytes of lengths per host), not every host every ask: per object
    ``[n, writer, key, nbytes]``, ``n`` its place in the needer's asks (the messages' global
    order). A bad ask (not what the needer's plan sources from this provider, or a key that is
    not that writer's object) is still answered -- with zeros -- so that no receive waits
    forever; its error fails every host in the status round (``tag[2]``).
    """
    rank = group.rank
    sizes = object_sizes(manifest)
    writers = object_writers(manifest)
    bad: list[str] = []
    mine: dict[int, list[list[Any]]] = {}
    messages: list[Message] = []
    for i in sorted(set(needed)):
        w = writers[i] if 0 <= i < len(writers) else None
        src = _peer_source(plan, rank, w)
        if src is None:
            bad.append(f"object {i} is not one its plan fetches from a peer")
            continue
        n = len(messages)
        mine.setdefault(src, []).append([n, w, manifest.objects[i], sizes[i]])
        messages.append(Message((rank, n), src, rank, sizes[i], (w, manifest.objects[i], None)))
    asked = group.exchange({p: [memoryview(json.dumps(a).encode())] for p, a in mine.items()})
    for needer, data in sorted(asked.items()):
        for n, w, key, nbytes in json.loads(data):
            why = _bad_ask(plan, rank, needer, w, key, nbytes)
            # Even a bad ask gets the bytes it waits for (zeros): its receive must not hang.
            length = nbytes if isinstance(nbytes, int) and nbytes >= 0 else 0
            messages.append(Message((needer, n), rank, needer, length, (w, key, why)))
    return messages, bad


def _bad_ask(plan: RestorePlan, rank: int, needer: int, writer: Any, key: Any, nbytes: Any) -> str | None:
    """Why ``needer``'s ask of this host for ``writer``'s object ``key`` is not one to answer, or None."""
    if not isinstance(writer, int) or not isinstance(key, str) or not isinstance(nbytes, int) or nbytes < 0:
        return f"host {needer} asked for {key!r} of host {writer!r} with a malformed ask"
    if _peer_source(plan, needer, writer) != rank:
        return f"host {needer} asked for host {writer}'s object {key!r}, which its plan does not fetch from host {rank}"
    if object_host(key) != writer:
        return f"host {needer} asked for {key!r} as host {writer}'s object, which its name does not say"
    return None


def _peer_source(plan: RestorePlan, needer: int, writer: int | None) -> int | None:
    """The peer ``needer`` fetches ``writer``'s objects from; None if not a peer (or no writer)."""
    if writer is None:
        return None
    try:
        tier, provider = plan.source(needer, writer)
    except CheckpointNotFoundError:
        return None
    return provider if tier == PEER else None


class RoutedBackend(ReadOnlyBackend):
    """A read-only view that sends each key to where this host's plan says its bytes are.

    Counts the bytes read from each tier (``bytes_from``), for the restore report.
    """

    read_only_reason = "a restore view is read-only"

    def __init__(self, url: str, received: dict[str, bytearray]) -> None:
        self._url = url
        self.received = received
        #: A format-2 manifest's fragments this host was sent (manifest bytes: not counted as data read).
        self.fragments: dict[str, bytes] = {}
        self.routes: dict[str, tuple[str, Backend, str]] = {}
        self.bytes_from: dict[str, int] = {LOCAL: 0, PEER: 0, DURABLE: 0}
        self.capabilities = Capabilities(read_only=True, concurrency=16)

    @property
    def url(self) -> str:
        return self._url

    def route(self, key: str, tier: str, backend: Backend, key_there: str) -> None:
        self.routes[key] = (tier, backend, key_there)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        if key in self.fragments:
            frag = memoryview(self.fragments[key])
            if rng.end > len(frag):
                raise ValueError(f"{key}: range [{rng.start}, {rng.end}) past the {len(frag)} bytes received")
            scatter_bytes(frag[rng.start : rng.end], buffers)
            return
        if key in self.received:
            data = memoryview(self.received[key])
            if rng.end > len(data):
                raise ValueError(f"{key}: range [{rng.start}, {rng.end}) past the {len(data)} bytes received")
            scatter_bytes(data[rng.start : rng.end], buffers)
            self.bytes_from[PEER] += rng.length
            return
        try:
            tier, backend, there = self.routes[key]
        except KeyError:
            raise FileNotFoundError(f"{self._url}/{key}: not routed to any tier") from None
        await backend.read_into(there, rng, buffers)
        self.bytes_from[tier] += rng.length

    async def stat(self, key: str) -> ObjectInfo:
        if key in self.fragments:
            return ObjectInfo(key, len(self.fragments[key]), 0.0)
        if key in self.received:
            return ObjectInfo(key, len(self.received[key]), 0.0)
        if key not in self.routes:
            raise FileNotFoundError(f"{self._url}/{key}: not routed to any tier")
        _tier, backend, there = self.routes[key]
        info = await backend.stat(there)
        return ObjectInfo(key, info.size, info.mtime)


    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return []

