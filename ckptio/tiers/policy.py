"""Tier policies and the restore decision, as pure functions of what every host reported.

Nothing here does IO or talks to other hosts: the manager gathers each
host's :class:`Holding` list, and every host runs :func:`plan_restore` on
the same gathered data, so all hosts reach the same decision without a
further round trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from ..errors import CheckpointNotFoundError
from ..retention import Retention, SaveInterval

__all__ = [
    "DURABLE",
    "LOCAL",
    "PEER",
    "TIERS",
    "Holding",
    "RestorePlan",
    "Retention",
    "TierPolicy",
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
    """What every host restores and from where.

    ``sources[(needer, writer)]`` is ``(tier, provider)``: ``LOCAL`` (the
    needer holds it), ``PEER`` (``provider`` sends it) or ``DURABLE``
    (provider None). ``manifest_from`` is the host that broadcasts the
    manifest (None: every host reads it from the durable tier).
    """

    step: int
    checkpoint_id: str | None
    num_hosts: int | None
    manifest_from: int | None
    in_durable: bool
    sources: dict[tuple[int, int], tuple[str, int | None]]

    def source(self, needer: int, writer: int) -> tuple[str, int | None]:
        """Where ``needer`` gets ``writer``'s objects (only ever asked for the step's writers)."""
        if (needer, writer) in self.sources:
            return self.sources[(needer, writer)]
        if self.manifest_from is None and self.in_durable:
            return (DURABLE, None)
        raise CheckpointNotFoundError(
            f"step {self.step}: host {needer} cannot get host {writer}'s objects from the tiers allowed")


def _sources_for(
    holders: dict[int, list[Holding]], num_hosts: int, world: int, in_durable: bool, tiers: Collection[str]
) -> dict[tuple[int, int], tuple[str, int | None]] | None:
    """Every (needer, writer) source of one checkpoint; None if some writer's objects are nowhere allowed.

    A pair may stay without a source only when ``tiers`` rules out peers (a
    host then reads only what it holds itself): that host fails if its
    target needs that writer's objects.
    """
    out: dict[tuple[int, int], tuple[str, int | None]] = {}
    for w in range(num_hosts):
        hs = holders.get(w, []) if (LOCAL in tiers or PEER in tiers) else []
        if not hs and not (DURABLE in tiers and in_durable):
            return None
        # The writer's own copy first (it is the one kept longest), then replicas; lowest rank breaks ties.
        ranked = sorted(hs, key=lambda h: (not h.own, h.rank))
        for r in range(world):
            others = [h for h in ranked if h.rank != r]
            if LOCAL in tiers and any(h.rank == r for h in hs):
                out[(r, w)] = (LOCAL, r)
            elif PEER in tiers and others:
                out[(r, w)] = (PEER, others[0].rank)
            elif DURABLE in tiers and in_durable:
                out[(r, w)] = (DURABLE, None)
    return out


def plan_restore(
    holdings: Sequence[Holding],
    durable_steps: Collection[int],
    world: int,
    *,
    step: int | None = None,
    tiers: Collection[str] = TIERS,
) -> RestorePlan:
    """The newest checkpoint complete in some tier (or ``step``), and each host's source per writer.

    A checkpoint is complete in the fast tiers when every writer's objects
    are held by some host (its own copy or a partner's replica) under the
    same checkpoint id; it is complete in the durable tier when committed
    there. Per writer, a host reads what it holds itself, else what a peer
    holds, else the durable tier: the fastest place first.
    """
    bad = set(tiers) - set(TIERS)
    if bad or not tiers:
        raise ValueError(f"tiers must be a non-empty subset of {TIERS}, got {sorted(tiers)}")
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
    for s, _pref, maybe_id in candidates:
        in_durable = s in durable
        if maybe_id is None:
            # Only the durable tier has it. (A step with fast-tier copies too was tried
            # first, with the durable tier filling in the writers the fast tiers lack.)
            return RestorePlan(s, None, None, None, True, {})
        cid = maybe_id
        hs = by_ckpt[(s, cid)]
        num_hosts = hs[0].num_hosts
        holders: dict[int, list[Holding]] = {}
        for h in hs:
            holders.setdefault(h.writer, []).append(h)
        sources = _sources_for(holders, num_hosts, world, in_durable, tiers)
        if sources is None:
            continue
        return RestorePlan(s, cid, num_hosts, min(h.rank for h in hs), in_durable, sources)
    what = f"step {step}" if step is not None else "any checkpoint"
    raise CheckpointNotFoundError(
        f"no tier among {list(tiers)} holds {what} completely "
        f"(fast-tier copies: {sorted({(h.step, h.writer, h.rank) for h in holdings})}; durable: {sorted(durable)})"
    )
