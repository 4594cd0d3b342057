"""The tiers' restart plan at scale (issue 33): the same sources as the every-pair plan it replaces, a
broadcast that grows with what was lost (not with the job), and a non-coordinator that receives a few
hundred bytes for the decision whatever the number of hosts.

The every-pair plan (``_pairs`` below) is kept ONLY as a test oracle: it is what ``plan_restore``
computed before, a dict of every (needer, writer) pair.
"""

from __future__ import annotations

import json
import random
from collections.abc import Collection, Sequence

import pytest

from ckptio.errors import CheckpointNotFoundError
from ckptio.tiers import DURABLE, LOCAL, PEER, TIERS, Holding, RestorePlan, plan_restore


def _pairs(holdings: Sequence[Holding], durable: Collection[int], world: int, step: int | None,
           tiers: Collection[str]) -> tuple[int, str | None, dict[tuple[int, int], tuple[str, int | None]]] | None:
    """The old plan: (step, checkpoint id, every (needer, writer) source); None if nothing is complete."""
    durable = set(durable) if DURABLE in tiers else set()
    by: dict[tuple[int, str], list[Holding]] = {}
    for h in holdings:
        by.setdefault((h.step, h.checkpoint_id), []).append(h)
    cands = [(s, 1, c) for s, c in by] + [(s, 0, None) for s in durable]
    cands = sorted((c for c in cands if step is None or c[0] == step), key=lambda c: (c[0], c[1], c[2] or ""),
                   reverse=True)
    for s, _p, cid in cands:
        if cid is None:
            return s, None, {}
        per: dict[int, list[Holding]] = {}
        for h in by[(s, cid)]:
            per.setdefault(h.writer, []).append(h)
        out: dict[tuple[int, int], tuple[str, int | None]] = {}
        ok = True
        for w in range(by[(s, cid)][0].num_hosts):
            hs = per.get(w, []) if (LOCAL in tiers or PEER in tiers) else []
            if not hs and not (DURABLE in tiers and s in durable):
                ok = False
                break
            ranked = sorted(hs, key=lambda h: (not h.own, h.rank))
            for r in range(world):
                others = [h for h in ranked if h.rank != r]
                if LOCAL in tiers and any(h.rank == r for h in hs):
                    out[(r, w)] = (LOCAL, r)
                elif PEER in tiers and others:
                    out[(r, w)] = (PEER, others[0].rank)
                elif DURABLE in tiers and s in durable:
                    out[(r, w)] = (DURABLE, None)
        if ok:
            return s, cid, out
    return None


def _source(plan: RestorePlan, r: int, w: int) -> tuple[str, int | None] | None:
    try:
        return plan.source(r, w)
    except CheckpointNotFoundError:
        return None


def _scenario(rng: random.Random) -> tuple[list[Holding], list[int], int]:
    """Random holdings: a ring of replicas at some offset, lost hosts, lagging or failed replicas,
    a step committed under another id on some hosts, and sometimes a job resized since."""
    n = rng.choice([1, 2, 3, 4, 5, 8])
    world = rng.choice([n, n, max(1, n // 2), n + 2])
    off = rng.randrange(1, n) if n > 1 else 0
    lost = set(rng.sample(range(world), rng.randrange(0, min(3, world) + 1)))
    out: list[Holding] = []
    for step in (3, 4, 5):
        cid = f"c{step}" if rng.random() < 0.8 else f"x{step}"
        for r in range(min(n, world)):
            if r not in lost and rng.random() < 0.9:
                out.append(Holding(r, step, cid if rng.random() < 0.9 else "other", r, n, True))
        for w in range(n):
            holder = (w + off) % world
            if off and holder != w and holder not in lost and rng.random() < (0.9 if step == 5 else 0.4):
                out.append(Holding(holder, step, cid, w, n, False))
    durable = sorted(rng.sample([2, 3, 4, 5], rng.randrange(0, 3)))
    return out, durable, world


def test_plan_matches_the_every_pair_plan():
    rng = random.Random(33)
    tier_sets = [TIERS, (LOCAL,), (PEER,), (DURABLE,), (LOCAL, PEER), (LOCAL, DURABLE), (PEER, DURABLE)]
    checked = 0
    for _ in range(400):
        holdings, durable, world = _scenario(rng)
        tiers = rng.choice(tier_sets)
        step = rng.choice([None, None, 4])
        want = _pairs(holdings, durable, world, step, tiers)
        if want is None:
            with pytest.raises(CheckpointNotFoundError):
                plan_restore(holdings, durable, world, step=step, tiers=tiers)
            continue
        plan = plan_restore(holdings, durable, world, step=step, tiers=tiers)
        wire = RestorePlan.from_json(json.loads(json.dumps(plan.to_json())))  # as a non-coordinator gets it
        assert (plan.step, plan.checkpoint_id) == want[:2]
        writers = plan.num_hosts if plan.num_hosts is not None else 0
        for r in range(world):
            for w in range(writers):
                expected = want[2].get((r, w)) if want[1] is not None else (DURABLE, None)
                assert _source(plan, r, w) == expected == _source(wire, r, w), (r, w, tiers, holdings)
                checked += 1
    assert checked > 1000  # the scenarios did reach the sources


def ring(n: int, step: int, lost: Collection[int] = (), replicas: bool = True) -> list[Holding]:
    out = []
    for r in range(n):
        if r not in lost:
            out.append(Holding(r, step, f"c{step}", r, n, True))
            if replicas:
                out.append(Holding(r, step, f"c{step}", (r - 1) % n, n, False))
    return out


@pytest.mark.parametrize("n", [64, 4096])
def test_the_broadcast_plan_grows_with_what_was_lost_not_with_the_job(n):
    lost = n // 2
    plan = plan_restore(ring(n, 7, lost=[lost]) + ring(n, 6, replicas=False), [5], n)
    assert plan.step == 7 and plan.replica_offset == 1
    # The lost host's own copy is gone, and so is the replica it kept of its predecessor.
    assert plan.exceptions == {lost: (lost + 1,), lost - 1: (lost - 1,)}
    assert plan.source(lost, lost) == (PEER, lost + 1) and plan.source(lost + 1, lost) == (LOCAL, lost + 1)
    assert plan.source(0, n - 1) == (LOCAL, 0) and plan.source(3, 9) == (PEER, 9)
    assert len(json.dumps(plan.to_json())) < 400  # the same at 64 and 4096 hosts
    # The lost host and its partner: the newest step is incomplete, the one before is the durable one's.
    plan = plan_restore(ring(n, 7, lost=[lost, lost + 1]) + ring(n, 6, lost=[lost, lost + 1], replicas=False),
                        [6], n)
    assert plan.step == 6 and plan.in_durable and plan.source(lost, lost) == (DURABLE, None)
    assert len(json.dumps(plan.to_json())) < 400


def test_not_found_names_what_is_held_boundedly():
    with pytest.raises(CheckpointNotFoundError, match=r"\.\.\. \(\d+ in all\)") as e:
        plan_restore(ring(4096, 7, lost=[5], replicas=False), [], 4096)
    assert len(str(e.value)) < 1000  # broadcast to every host: it must not grow with the job
