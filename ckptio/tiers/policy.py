"""Tier policies and the restore decision, as pure functions of what every host reported.

Nothing here does IO or talks to other hosts: the manager gathers each
host's :class:`Holding` list, and every host runs :func:`plan_restore` on
the same gathered data, so all hosts reach the same decision without a
further round trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ckptio.errors import CheckpointNotFoundError
from ckptio.manage.retention import Retention, SaveInterval

__all__ = [
    "DURABLE",
    "LOCAL",
    "PEER",
    "TIERS",
    "Holding",
    "RestorePlan",
    "Retention",
    "TierPolicy",
    "check_tiers",
    "plan_restore",
]

#: Where a host's bytes come from at restore, fastest first.
LOCAL, PEER, DURABLE = "local", "peer", "durable"
TIERS: tuple[str, ...] = (LOCAL, PEER, DURABLE)


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """How the tiers are used.

    Args:
        replicate_every: every save whose step is a multiple of this is copied
            to the durable tier in the background (0: never).
        queue_size: replication jobs waiting per queue (durable, peer); a save
            waits for room only when its queue is full.
        coalesce: when the durable tier falls behind, copy only the newest
            waiting step and skip the older ones (all hosts agree on which).
        fast: retention of each host's fast tier (steps a queue still needs
            are kept until it is done with them).
        durable: retention of the durable tier (run by host 0 after each durable commit). Bounded by
            default (the newest 3 plus every ``keep_period``-th): a durable tier is never left to grow forever.
        peer_replication: send each host's latest snapshot to its partner.
        partner_offset: host ``r``'s partner is ``(r + partner_offset) % N``.
        save_interval_steps: ``save`` saves only steps that are multiples of this.
        retry_backoff_s, retry_backoff_max_s: a failed durable round is retried after ``retry_backoff_s``,
            doubling per failure up to ``retry_backoff_max_s`` (later rounds never skip it unless ``coalesce``).
        max_backlog: durable steps owed (failed, waiting for a retry) at most; beyond that the oldest is
            given up (logged): it keeps a host's fast tier bounded while the durable tier is down.
        lag_warn_steps: log a warning whenever the durable tier is at least this many steps behind.
        replica_before_save: a save first waits until the previous step's peer round is done (its replica
            marked complete on the partner, or the round failed), so losing one host costs at most one
            save interval, under load too. The cost: when a peer round takes longer than the interval
            between saves, the training step waits out the difference at the next save. False: saves
            never wait for peers; replication may then fall behind (up to ``queue_size`` steps, older
            ones coalesced away) and a host loss costs every step since its newest replicated one.
    """

    replicate_every: int = 1
    queue_size: int = 2
    coalesce: bool = False
    fast: Retention = Retention(max_to_keep=2)
    durable: Retention = Retention(max_to_keep=3)
    peer_replication: bool = True
    partner_offset: int = 1
    save_interval_steps: int = 1
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 120.0
    max_backlog: int = 4
    lag_warn_steps: int = 2
    replica_before_save: bool = True

    def __post_init__(self) -> None:
        if (self.replicate_every < 0 or self.queue_size < 1 or self.save_interval_steps < 1
                or self.retry_backoff_s < 0 or self.retry_backoff_max_s < self.retry_backoff_s
                or self.max_backlog < 1 or self.lag_warn_steps < 1):
            raise ValueError(f"invalid tier policy {self}")

    @property
    def interval(self) -> SaveInterval:
        """The steps :meth:`TieredCheckpointManager.save` saves (``save_interval_steps``)."""
        return SaveInterval(self.save_interval_steps)

    def backoff(self, failures: int) -> float:
        """Seconds to wait before the retry that follows ``failures`` failed rounds of one step."""
        return min(self.retry_backoff_max_s, self.retry_backoff_s * 2 ** max(0, failures - 1))

    def replicates(self, step: int) -> bool:
        """Whether ``step`` goes to the durable tier."""
        return self.replicate_every > 0 and step % self.replicate_every == 0

    def partner(self, rank: int, size: int) -> int:
        """The host that keeps ``rank``'s latest snapshot."""
        return (rank + self.partner_offset) % size


@dataclasses.dataclass(frozen=True)
class Holding:
    """Host ``rank`` holds writer ``writer``'s objects of a committed checkpoint in its fast tier.

    ``own`` is True for the host's own fast-tier copy, False for a replica it
    keeps for a partner.
    """

    rank: int
    step: int
    checkpoint_id: str
    writer: int
    num_hosts: int
    own: bool

    def to_json(self) -> list[Any]:
        return [self.rank, self.step, self.checkpoint_id, self.writer, self.num_hosts, self.own]

    @classmethod
    def from_json(cls, v: Sequence[Any]) -> Holding:
        return cls(int(v[0]), int(v[1]), str(v[2]), int(v[3]), int(v[4]), bool(v[5]))


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What every host restores and from where, in a size that does not grow with the job's pairs of hosts.

    Per writer, the plan keeps the hosts that hold its objects (its own copy first, then replicas,
    lowest rank first); :meth:`source` derives any host's source from them in O(1). Holders follow
    one rule -- writer ``w`` is held by ``w`` itself and, with ``replica_offset``, by
    ``(w + replica_offset) % world`` -- except for the writers listed in ``exceptions`` (lost hosts,
    missing replicas, writers beyond a resized job): what the coordinator broadcasts after a loss
    grows with what went wrong, not with the number of hosts. ``manifest_from`` is the host that
    broadcasts the manifest, from its copy of host 0's part where it holds one (None: every host
    reads it from the durable tier).
    """

    step: int
    checkpoint_id: str | None
    num_hosts: int | None
    manifest_from: int | None
    in_durable: bool
    world: int = 1
    tiers: tuple[str, ...] = TIERS
    replica_offset: int | None = None
    exceptions: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def holders(self, writer: int) -> tuple[int, ...]:
        """The hosts that hold ``writer``'s objects of the step, in the order they serve them."""
        if self.checkpoint_id is None or self.num_hosts is None or not 0 <= writer < self.num_hosts:
            return ()
        got = self.exceptions.get(writer)
        return got if got is not None else _rule(writer, self.world, self.replica_offset)

    def source(self, needer: int, writer: int) -> tuple[str, int | None]:
        """Where ``needer`` gets ``writer``'s objects: ``(LOCAL, needer)`` (it holds them), ``(PEER,
        provider)`` or ``(DURABLE, None)``; CheckpointNotFoundError when no tier allowed has them for it."""
        tiers = self.tiers
        hs = self.holders(writer) if (LOCAL in tiers or PEER in tiers) else ()
        if LOCAL in tiers and needer in hs:
            return (LOCAL, needer)
        if PEER in tiers:
            for h in hs:
                if h != needer:
                    return (PEER, h)
        if DURABLE in tiers and self.in_durable:
            return (DURABLE, None)
        raise CheckpointNotFoundError(
            f"step {self.step}: host {needer} cannot get host {writer}'s objects from the tiers allowed")

    def to_json(self) -> dict[str, Any]:
        """The plan as the coordinator broadcasts it (its exceptions sorted, for a stable encoding)."""
        return {"step": self.step, "checkpoint_id": self.checkpoint_id, "num_hosts": self.num_hosts,
                "manifest_from": self.manifest_from, "in_durable": self.in_durable, "world": self.world,
                "tiers": list(self.tiers), "replica_offset": self.replica_offset,
                "exceptions": [[w, list(hs)] for w, hs in sorted(self.exceptions.items())]}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RestorePlan:
        return cls(int(d["step"]), d["checkpoint_id"], d["num_hosts"], d["manifest_from"], bool(d["in_durable"]),
                   int(d["world"]), tuple(d["tiers"]), d["replica_offset"],
                   {int(w): tuple(int(h) for h in hs) for w, hs in d["exceptions"]})


def _rule(writer: int, world: int, offset: int | None) -> tuple[int, ...]:
    """The holders the plan's rule gives ``writer``: itself, then its partner at ``offset``."""
    if writer >= world:
        return ()
    if offset is None or (writer + offset) % world == writer:
        return (writer,)
    return (writer, (writer + offset) % world)


def _ranked_holders(hs: Sequence[Holding]) -> tuple[int, ...]:
    """The holders of one writer's objects in the order they serve: its own copy (kept longest)
    first, then replicas; the lowest rank breaks ties."""
    return tuple(dict.fromkeys(h.rank for h in sorted(hs, key=lambda h: (not h.own, h.rank))))


def _manifest_holder(ranked: Mapping[int, tuple[int, ...]], hs: Sequence[Holding]) -> int:
    """The host that broadcasts the manifest at a restore: the first holder of host 0's part.

    Host 0's part is where the job's manifest lives (host 0 commits it; its partner's replica
    keeps it): every other host's fast tier holds only its own part (issue #33). Without any
    holder of host 0's part (host 0 and its partner lost; the plan then has the step in the durable
    tier), the lowest-ranked holder of the step, which broadcasts the durable tier's manifest
    (:func:`ckptio.tiers.rootcast.manifest_to_send`).
    """
    holders = ranked.get(0, ())
    return holders[0] if holders else min(h.rank for h in hs)


def _compact(ranked: Mapping[int, tuple[int, ...]], num_hosts: int, world: int
             ) -> tuple[int | None, dict[int, tuple[int, ...]]]:
    """The partner offset whose rule fits the most writers, and the writers it does not fit."""
    offsets: dict[int, int] = {}
    for w, hs in ranked.items():
        for h in hs[1:2]:  # a replica, when the writer's own copy comes first
            if hs[0] == w:
                d = (h - w) % world
                offsets[d] = offsets.get(d, 0) + 1
    best: tuple[int | None, dict[int, tuple[int, ...]]] | None = None
    for off in [None, *sorted(offsets, key=lambda d: -offsets[d])[:1]]:
        exc = {w: hs for w in range(num_hosts) if (hs := ranked.get(w, ())) != _rule(w, world, off)}
        if best is None or len(exc) < len(best[1]):
            best = (off, exc)
    assert best is not None
    return best


def check_tiers(tiers: Collection[str]) -> None:
    """ValueError unless ``tiers`` is a non-empty subset of :data:`TIERS`."""
    bad = set(tiers) - set(TIERS)
    if bad or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {sorted(tiers)}")


def plan_restore(
    holdings: Sequence[Holding],
    durable_steps: Collection[int],
    world: int,
    *,
    step: int | None = None,
    tiers: Collection[str] = TIERS,
) -> RestorePlan:
    """The newest checkpoint complete in some tier (or ``step``), and where each writer's objects are.

    A checkpoint is complete in the fast tiers when every writer's objects
    are held by some host (its own copy or a partner's replica) under the
    same checkpoint id; it is complete in the durable tier when committed
    there. Per writer, a host reads what it holds itself, else what a peer
    holds, else the durable tier: the fastest place first
    (:meth:`RestorePlan.source`). Time: linear in the holdings and the
    writers of the checkpoints tried, never in pairs of hosts.
    """
    check_tiers(tiers)
    tiers = tuple(t for t in TIERS if t in tiers)
    durable = set(durable_steps) if DURABLE in tiers else set()
    by_ckpt: dict[tuple[int, str], list[Holding]] = {}
    for h in holdings:
        by_ckpt.setdefault((h.step, h.checkpoint_id), []).append(h)
    candidates: list[tuple[int, int, str | None]] = []  # (step, preference, checkpoint id)
    candidates += [(s, 1, cid) for s, cid in by_ckpt]
    candidates += [(s, 0, None) for s in durable]
    if step is not None:
        candidates = [c for c in candidates if c[0] == step]
    # Newest step first; for one step, a fast-tier checkpoint (with a known id) before the durable one.
    candidates.sort(key=lambda c: (c[0], c[1], c[2] or ""), reverse=True)
    fast = LOCAL in tiers or PEER in tiers
    for s, _pref, maybe_id in candidates:
        in_durable = s in durable
        if maybe_id is None:
            # Only the durable tier has it. (A step with fast-tier copies too was tried
            # first, with the durable tier filling in the writers the fast tiers lack.)
            return RestorePlan(s, None, None, None, True, world, tiers)
        hs = by_ckpt[(s, maybe_id)]
        num_hosts = hs[0].num_hosts
        per_writer: dict[int, list[Holding]] = {}
        for h in hs:
            per_writer.setdefault(h.writer, []).append(h)
        if not in_durable and not (fast and all(w in per_writer for w in range(num_hosts))):
            continue  # some writer's objects are nowhere allowed
        ranked = {w: _ranked_holders(v) for w, v in per_writer.items() if w < num_hosts}
        offset, exceptions = _compact(ranked, num_hosts, world)
        return RestorePlan(s, maybe_id, num_hosts, _manifest_holder(ranked, hs), in_durable, world, tiers,
                           offset, exceptions)
    what = f"step {step}" if step is not None else "any checkpoint"
    held = sorted({(h.step, h.writer, h.rank) for h in holdings})
    shown = ", ".join(map(str, held[:8])) + (f", ... ({len(held)} in all)" if len(held) > 8 else "")
    raise CheckpointNotFoundError(
        f"no tier among {list(tiers)} holds {what} completely "
        f"(fast-tier copies (step, writer, host): [{shown}]; durable: {sorted(durable)[-8:]})"
    )
