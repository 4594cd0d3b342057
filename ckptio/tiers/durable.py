"""The durable tier's rounds: copy every host's own objects there, then host 0 commits the manifest, last.

:func:`durable_round` copies every host's own objects of a fast-tier step to
the durable tier (:func:`ckptio.copy.copy_keys`) and then host 0 commits the
manifest there, last, and runs the durable tier's retention. Host 0 copies by
the manifest; every other host by its commit record (its fast tier holds no
manifest, #33), which carries each object's index in the manifest, so that
its keys are those :func:`ckptio.copy.rekey` gives the manifest's copy. A
run killed mid-copy leaves objects without a manifest (invisible to
readers); :func:`durable_recovery`, the first thing a new run's durable
worker does, finds fast-tier steps newer than the durable tier's newest and
copies them again, keeping the objects that already arrived whole.
"""

from __future__ import annotations

import logging

from ckptio.backends.base import join_key

from ..copy import StoredExtent, copy_keys, object_extents, object_writers, rekey, rekey_one, stored_extents
from ..distributed import join_errors
from ..engine import run_sync
from ..store.intents import Lease, new_id
from ..manifest import Manifest
from ..names import INTENT_PREFIX, parse_object
from ..store import CheckpointStore, sweeps_temporaries_by_prefix
from ..store.parts import PartRecord
from .group import PeerGroup
from .peer import checkpoint_disagreement, holdings
from .policy import TierPolicy
from .replicator import ReplicationError

__all__ = ["durable_recovery", "durable_round"]

log = logging.getLogger("ckptio.tiers.replicator")


def _own_indices(own: CheckpointStore, manifest_objects: list[str], writers: list[int | None], rank: int) -> list[int]:
    """The objects this host copies: those it wrote, plus any unreferenced ones it has."""
    mine = [i for i, w in enumerate(writers) if w == rank]
    loose = [i for i, w in enumerate(writers) if w is None]
    for i in loose:
        try:
            run_sync(own.io.stat(manifest_objects[i]))
            mine.append(i)
        except FileNotFoundError:
            pass
    return sorted(mine)


def durable_round(
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, step: int, policy: TierPolicy,
    unclean: set[int] | None = None,
) -> None:
    """Copy ``step`` from every host's fast tier to the durable tier; host 0 commits it there, last.

    Collective. Raises ReplicationError on every host alike if the step is
    not complete in the fast tier, the durable tier holds another checkpoint
    under that step, or any host's copy failed (then nothing is committed).
    ``unclean``: the durable steps whose killed copies' leftovers a live-looking
    intent still protected at an earlier round (kept across rounds by the caller;
    see :func:`_after_durable_commit`).
    """
    step_dir = str(step)
    rank = group.rank
    # Nothing before a collective may raise on one host only: the others would wait forever.
    m, part = _source_or_none(own, step_dir, rank)
    cid = m.checkpoint_id if m is not None else part.checkpoint_id if part is not None else None
    recs = group.gather(cid)
    # Host 0 alone decides whether to copy ("copy"), there is nothing to do ("done"), or the round fails.
    plan: dict[str, object] = {"do": "copy", "error": None}
    if recs is not None:
        plan = _durable_plan(durable, step_dir, recs)
    plan = group.broadcast(plan)
    if plan["do"] == "done":
        log.info("durable copy of step %d: already committed there", step)
        return
    if plan["do"] != "copy":
        raise ReplicationError(f"durable copy of step {step}: {plan['error']}")
    error: str | None = None
    out: Manifest | None = None
    lease: Lease | None = None
    try:
        # Deterministic: the same keys (or the same error) on every host, from the manifest or a record.
        objects, out = _objects_to_copy(own, durable, step_dir, m, part, rank)
        # This host's copy is a save into the durable tier: it announces an intent before its first object
        # (covering the source's save ids, which the copied objects keep), so that no deleter takes them
        # for a crash's leftovers; kept until the commit's verdict, retired only on success.
        writers = {n.save_id for _k, dk, _e in objects if (n := parse_object(dk)) is not None}
        lease = Lease(durable, step_dir, new_id(), host=rank, covers=writers).start()
        stats = run_sync(copy_keys(own, durable, objects))
        log.info("durable copy of step %d: host %d written (%d objects, %d kept from an earlier try)",
                 step, rank, stats.written, stats.kept)
    except BaseException as e:
        error = f"host {rank}: {type(e).__name__}: {e}"
    errors = group.gather(error)
    verdict: dict[str, object] = {"ok": False, "error": ""}
    committed = False
    if errors is not None:
        failed = [e for e in errors if e]
        verdict = {"ok": not failed, "error": join_errors(failed)}
        if not failed:
            try:
                assert out is not None  # host 0 copies by the manifest
                run_sync(durable.commit(step_dir, out))
                committed = True
                log.info("durable copy of step %d: committed", step)
            except FileExistsError:
                pass  # the same checkpoint, committed by an earlier try that lost its reply
            except BaseException as e:
                verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
    verdict = group.broadcast(verdict)
    if lease is not None:
        lease.close(retire=bool(verdict["ok"]))
    if committed:
        # After the intents are retired: the cleanup must see only dead attempts' intents.
        _after_durable_commit(durable, step_dir, policy, set() if unclean is None else unclean)
    if not verdict["ok"]:
        raise ReplicationError(f"durable copy of step {step} failed: {verdict['error']}")


def _after_durable_commit(
    durable: CheckpointStore, step_dir: str, policy: TierPolicy, unclean: set[int]
) -> None:
    """Host 0, once a step is committed in the durable tier: retention, and killed copies' leftovers.

    A copy killed midway (an earlier run's, or a re-saved step's earlier checkpoint) leaves objects
    that no manifest names and an intent that stops beating. They go through the store's step sweep
    (:meth:`CheckpointStore.sweep_step`, the rules of the orphan sweep for one step: only ckptio's
    names, never a live save's objects) -- of this step whenever its directory holds an intent, and
    of each older step directory that has no manifest; never a listing of every key of the durable
    root. A healthy round costs one listing of the step's intents and one of the root's step directories.
    A dead copy's intent protects its objects until its lease runs out (``CheckpointStore.lease_s``):
    after a restart quicker than that, a swept step still holds an intent; it joins ``unclean`` and
    is swept again at each later round until none is left.
    """
    committed: list[int] = []
    try:
        committed = _durable_retention(durable, policy)
    except Exception as e:  # noqa: BLE001 -- retention failing leaves extra steps, never loses one
        log.error("%s: durable retention failed: %r", durable.url, e)
    try:
        leftovers = run_sync(durable.io.list(join_key(step_dir, INTENT_PREFIX)))
        stray = [d for d in run_sync(durable.step_dirs()) if d < int(step_dir) and d not in committed]
        swept = sorted({*stray, *unclean, *([int(step_dir)] if leftovers else [])})
        for step in swept:
            report = run_sync(durable.sweep_step(step, grace_seconds=0.0))
            if report.deleted or report.spared_in_flight:
                log.info("%s: cleaned what interrupted copies left (%d objects, %d intents, %d temporaries; "
                         "%d spared in flight)", durable.where(str(step)), len(report.objects),
                         len(report.intents), len(report.temporaries), report.spared_in_flight)
            # An intent that survived the sweep looked live: its objects wait for a later round.
            if run_sync(durable.io.list(join_key(str(step), INTENT_PREFIX))):
                unclean.add(step)
            else:
                unclean.discard(step)
        if swept and not sweeps_temporaries_by_prefix(durable.backend):
            # A killed write leaves a temporary file that the step sweep cannot reach on this backend.
            # One untouched for a whole lease is a dead writer's (a live write keeps touching its file,
            # as a live save keeps beating); a younger one is left to gc. Root-wide, but only POSIX
            # backends have temporaries: on object stores this is a no-op that lists nothing.
            lease = durable.lease_s
            gone = run_sync(durable.io.sweep_temporaries(lease))
            if gone:
                log.info("%s: removed %d temporaries of killed writes", durable.url, len(gone))
    except Exception as e:  # noqa: BLE001 -- leftovers stay for gc; the checkpoint is committed
        log.warning("%s: cleaning an interrupted copy's leftovers failed: %r", durable.where(step_dir), e)


def _durable_plan(durable: CheckpointStore, step_dir: str, ids: list[str | None]) -> dict[str, object]:
    """Host 0, with every host's checkpoint id of the step: copy it, nothing to do, or fail (and why)."""
    disagreement = checkpoint_disagreement(ids)
    if disagreement is not None:
        return {"do": "fail", "error": disagreement}
    try:
        there: str | None = run_sync(durable.read_manifest(step_dir)).checkpoint_id
    except FileNotFoundError:
        there = None
    except Exception as e:
        return {"do": "fail", "error": f"reading {durable.where(step_dir)}: {type(e).__name__}: {e}"}
    if there == ids[0]:
        return {"do": "done", "error": None}
    if there is not None:
        return {"do": "fail", "error": f"{durable.where(step_dir)} holds another checkpoint"}
    return {"do": "copy", "error": None}


def _source_or_none(own: CheckpointStore, step_dir: str, rank: int) -> tuple[Manifest | None, PartRecord | None]:
    """What this host copies ``step_dir`` by: its standing commit record (a non-coordinator's fast tier holds
    no manifest, #33), else the committed manifest (host 0; a step saved before records carried indices).
    ``(None, None)`` if neither can be read (logged)."""
    try:
        if rank != 0:
            mine = [r for r in run_sync(own.parts.standing(step_dir)) if r.host == rank]
            if len(mine) == 1 and mine[0].sizes is not None and {"extents", "indices"} <= set(mine[0].extra):
                return None, mine[0]
        return run_sync(own.read_manifest(step_dir)), None
    except FileNotFoundError:
        return None, None
    except Exception as e:
        log.error("%s: unreadable manifest or commit record: %r", own.where(step_dir), e)
        return None, None


def _objects_to_copy(own: CheckpointStore, durable: CheckpointStore, step_dir: str, m: Manifest | None,
                     part: PartRecord | None, rank: int
                     ) -> tuple[list[tuple[str, str, list[StoredExtent]]], Manifest | None]:
    """``(key, durable key, extents)`` of each object this host copies -- by the manifest, those it wrote and
    any unreferenced ones it has; by its record, its own (named by their indices in the manifest) -- and the
    durable tier's manifest where this host copies by the manifest (host 0 commits it)."""
    if m is not None:
        out = rekey(m, step_dir, durable)
        extents = object_extents(m)
        return [(m.objects[i], out.objects[i], extents[i])
                for i in _own_indices(own, m.objects, object_writers(m), rank)], out
    assert part is not None
    return [(k, rekey_one(k, int(i), step_dir, durable), stored_extents(ex))
            for k, i, ex in zip(part.objects, part.extra["indices"], part.extra["extents"], strict=True)], None


def _durable_retention(durable: CheckpointStore, policy: TierPolicy) -> list[int]:
    """Delete the durable steps beyond the policy's retention; the committed steps that remain."""
    steps = run_sync(durable.committed_steps())
    doomed = policy.durable.doomed(steps)
    for s in doomed:
        run_sync(durable.delete(str(s)))
    return [s for s in steps if s not in doomed]


def durable_recovery(
    group: PeerGroup, own: CheckpointStore, durable: CheckpointStore, policy: TierPolicy
) -> list[int]:
    """Collective: the fast-tier steps to copy again after a restart (an earlier run died mid-copy).

    Those that every host holds whole, that the policy replicates, that the
    durable tier lacks (an earlier run's failed or killed round, older than the
    durable tier's newest or not), and that its retention would keep.
    """
    rec: dict[str, object] = {"steps": [], "durable": [], "error": None}
    try:
        mine = {(h.step, h.checkpoint_id) for h in holdings(own, None, group.rank) if policy.replicates(h.step)}
        rec["steps"] = [list(x) for x in sorted(mine)]
        if group.rank == 0:
            rec["durable"] = run_sync(durable.committed_steps())
    except Exception as e:
        rec["error"] = f"host {group.rank}: {type(e).__name__}: {e}"
    recs = group.gather(rec)
    # Host 0 alone works out the steps; the others receive only that list (bounded by retention).
    verdict: dict[str, object] = {"todo": [], "error": None}
    if recs is not None:
        errors = [str(r["error"]) for r in recs if r["error"]]
        if errors:
            verdict["error"] = join_errors(errors)
        else:
            common = set.intersection(*({tuple(x) for x in r["steps"]} for r in recs))  # type: ignore[union-attr]
            there = set(recs[0]["durable"])  # type: ignore[call-overload]
            # Every step the fast tiers hold whole and the durable tier lacks -- older than its newest
            # too (a failed round's step), unless its retention would delete it at once.
            held = sorted({s for s, _cid in common})
            doomed = set(policy.durable.doomed(sorted(there | set(held))))
            todo = [s for s in held if s not in there and s not in doomed]
            verdict["todo"] = todo[-1:] if policy.coalesce else todo
    verdict = group.broadcast(verdict)
    if verdict["error"]:
        raise ReplicationError(f"durable replicator: cannot tell what an earlier run left: {verdict['error']}")
    todo = [int(s) for s in verdict["todo"]]  # type: ignore[attr-defined]
    if todo:
        log.info("durable replicator: completing the copy of steps %s left by an earlier run", todo)
    return todo
