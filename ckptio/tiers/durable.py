"""The durable tier's rounds: copy every host's own objects there, then host 0 commits the manifest, last.

:func:`durable_round` copies every host's own objects of a fast-tier step to
the durable tier (:func:`ckptio.manage.copying.copy_keys`) and then host 0 commits the
manifest there, last, and runs the durable tier's retention. Every host copies
by its commit record (a non-coordinator's fast tier holds no manifest, #33),
which carries each object's index in the checkpoint, so that its keys are
those :func:`ckptio.manage.copying.rekey` gives the whole manifest's copy. A fast-tier
step that is a format-2 checkpoint (a save by many hosts) is copied as one:
each host also copies its own fragment and host 0 commits the root it holds
(:mod:`ckptio.tiers.durableroot`), parsing no other host's shards. A step
without records (one host's, or saved before records carried indices) is
copied by host 0's whole manifest and committed as format 1. A run killed
mid-copy leaves objects without a manifest (invisible to readers);
:func:`durable_recovery`, the first thing a new run's durable worker does,
finds fast-tier steps newer than the durable tier's newest and copies them
again, keeping the objects that already arrived whole.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ckptio.backends.base import join_key
from ckptio.coord.distributed import join_errors
from ckptio.engine import run_sync
from ckptio.manage.copying import (
    StoredExtent, copy_keys, object_extents, object_writers, rekey, rekey_one, stored_extents,
)
from ckptio.manifest import Manifest
from ckptio.manifest.names import INTENT_PREFIX, parse_object
from ckptio.store import CheckpointStore, sweeps_temporaries_by_prefix
from ckptio.store.transaction import WriteTransaction
from ckptio.store.parts import PartRecord
from ckptio.tiers.durableroot import durable_fragment, durable_root, exchange_fragments, fragment_save_id
from ckptio.tiers.group import PeerGroup
from ckptio.tiers.peer import checkpoint_disagreement, holdings
from ckptio.tiers.policy import TierPolicy
from ckptio.tiers.replicator import ReplicationError
from ckptio.tiers.rootcast import stored_root

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
    src = _source_or_none(own, step_dir, rank)
    recs = group.gather(src.checkpoint_id)
    # Host 0 alone decides whether to copy ("copy"), there is nothing to do ("done"), or the round fails;
    # and whether the copy is a format-2 one (each host's fragment copied, a root committed).
    plan: dict[str, object] = {"do": "copy", "error": None}
    if recs is not None:
        plan = {**_durable_plan(durable, step_dir, recs), "format": 2 if src.root is not None else 1}
    plan = group.broadcast(plan)
    if plan["do"] == "done":
        log.info("durable copy of step %d: already committed there", step)
        return
    if plan["do"] != "copy":
        raise ReplicationError(f"durable copy of step {step}: {plan['error']}")
    message = exchange_fragments(group, own, src.root) if plan.get("format") == 2 else None
    error, tx, ref = _copy_own(own, durable, step_dir, src, message, rank)
    sent = group.gather({"error": error, "fragment": ref})
    verdict: dict[str, object] = {"ok": False, "error": ""}
    committed = False
    if sent is not None:
        failed = [str(s["error"]) for s in sent if s["error"]]
        verdict = {"ok": not failed, "error": join_errors(failed)}
        if not failed:
            try:
                assert tx is not None  # host 0's own copy began it, and succeeded
                run_sync(_commit(own, durable, tx, src, [s["fragment"] for s in sent]))
                committed = True
                log.info("durable copy of step %d: committed", step)
            except FileExistsError:
                pass  # the same checkpoint, committed by an earlier try that lost its reply
            except BaseException as e:
                verdict = {"ok": False, "error": f"commit: {type(e).__name__}: {e}"}
    verdict = group.broadcast(verdict)
    if tx is not None:
        tx.end(ok=bool(verdict["ok"]))
    # Every host's intent retired before host 0 looks for leftovers: a live-looking intent of this very
    # round would have it sweep the step (reading its whole manifest) and keep sweeping it at later rounds.
    group.gather(None)
    if committed:
        # After the intents are retired: the cleanup must see only dead attempts' intents.
        _after_durable_commit(durable, step_dir, policy, set() if unclean is None else unclean)
    if not verdict["ok"]:
        raise ReplicationError(f"durable copy of step {step} failed: {verdict['error']}")


def _copy_own(own: CheckpointStore, durable: CheckpointStore, step_dir: str, src: _Source, message: bytes | None,
              rank: int) -> tuple[str | None, WriteTransaction | None, dict[str, Any] | None]:
    """Copy this host's objects (and, on format 2, its fragment) to the durable tier, in a write transaction.

    Returns why not (one line naming this host), the transaction (ended by the caller once the verdict
    is known), and the reference of the fragment written (format 2)."""
    tx: WriteTransaction | None = None
    try:
        # Deterministic: the same keys (or the same error) on every host, from the manifest or a record.
        objects = _objects_to_copy(own, durable, step_dir, src, rank)
        fragment = None
        if message is not None:
            assert src.part is not None  # format 2 is decided only where every host copies by its record
            fragment = durable_fragment(message, rank, src.part, step_dir, durable)
        # This host's copy is a save into the durable tier: it announces an intent before its first object
        # (covering the source's save ids, which the copied objects and its fragment keep), so that no
        # deleter takes them for a crash's leftovers; kept until the commit's verdict, retired only on success.
        writers = {n.save_id for _k, dk, _e in objects if (n := parse_object(dk)) is not None}
        if fragment is not None:
            writers.add(fragment_save_id(fragment.ref))
        tx = durable.begin_save(step_dir, host=rank, covers=writers, prepare=False)
        stats = run_sync(copy_keys(own, durable, objects))
        if fragment is not None:  # after its objects, as a save writes it; synced before the verdict
            run_sync(durable.io.write(fragment.ref.key, [memoryview(fragment.data)]))
            run_sync(durable.io.sync())
        log.info("durable copy of step %s: host %d written (%d objects, %d kept from an earlier try)",
                 step_dir, rank, stats.written, stats.kept)
        return None, tx, dataclasses.asdict(fragment.ref) if fragment is not None else None
    except BaseException as e:
        return f"host {rank}: {type(e).__name__}: {e}", tx, None


async def _commit(own: CheckpointStore, durable: CheckpointStore, tx: WriteTransaction, src: _Source,
                  fragments: list[Any]) -> None:
    """Host 0, once every host's copy succeeded: commit the durable manifest, last. Format 1: the
    fast tier's whole manifest, rekeyed. Format 2: the fast tier's root as stored, naming the
    fragments the hosts wrote, under a fresh fence."""
    step_dir = tx.step_dir
    if src.root is None:
        assert src.manifest is not None  # host 0 copies by the manifest
        await tx.commit_async(rekey(src.manifest, step_dir, durable))
        return
    stored = await stored_root(own, step_dir, src.root)
    out, data = durable_root(stored, fragments, durable.where(step_dir))
    await tx.commit_async(out, data)


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
        # The root alone (a format-2 copy's fragments are not needed to know its checkpoint).
        there: str | None = run_sync(durable.read_manifest(step_dir, shards=False)).checkpoint_id
    except FileNotFoundError:
        there = None
    except Exception as e:
        return {"do": "fail", "error": f"reading {durable.where(step_dir)}: {type(e).__name__}: {e}"}
    if there == ids[0]:
        return {"do": "done", "error": None}
    if there is not None:
        return {"do": "fail", "error": f"{durable.where(step_dir)} holds another checkpoint"}
    return {"do": "copy", "error": None}


@dataclasses.dataclass(frozen=True)
class _Source:
    """What this host copies a step by: its commit record (``part``), or host 0's whole ``manifest``
    (format 1: a step saved before records carried indices, or by one host); host 0 also has the
    fast tier's format-2 ``root`` when it copies by its record (the round is then a format-2 one)."""

    manifest: Manifest | None = None
    part: PartRecord | None = None
    root: Manifest | None = None

    @property
    def checkpoint_id(self) -> str | None:
        have = self.manifest or self.root or self.part
        return have.checkpoint_id if have is not None else None


def _source_or_none(own: CheckpointStore, step_dir: str, rank: int) -> _Source:
    """What this host copies ``step_dir`` by: its standing commit record (a non-coordinator's fast tier
    holds no manifest, #33; host 0's beside a format-2 root, whose fragments it then never loads), else
    the committed manifest, whole (host 0). Empty if neither can be read (logged)."""
    try:
        mine = [r for r in run_sync(own.parts.standing(step_dir)) if r.host == rank]
        part = mine[0] if len(mine) == 1 and mine[0].sizes is not None and \
            {"extents", "indices"} <= set(mine[0].extra) else None
        if rank != 0:
            return _Source(part=part) if part is not None else _Source(manifest=run_sync(own.read_manifest(step_dir)))
        root = run_sync(own.read_manifest(step_dir, shards=False))
        if part is not None and not root.complete and not root.bases and root.checkpoint_id == part.checkpoint_id:
            return _Source(part=part, root=root)
        return _Source(manifest=root if root.complete else run_sync(own.read_manifest(step_dir)))
    except FileNotFoundError:
        return _Source()
    except Exception as e:
        log.error("%s: unreadable manifest or commit record: %r", own.where(step_dir), e)
        return _Source()


def _objects_to_copy(own: CheckpointStore, durable: CheckpointStore, step_dir: str, src: _Source, rank: int
                     ) -> list[tuple[str, str, list[StoredExtent]]]:
    """``(key, durable key, extents)`` of each object this host copies -- by the manifest, those it wrote and
    any unreferenced ones it has; by its record, its own (named by their indices in the manifest)."""
    m, part = src.manifest, src.part
    if m is not None:
        out = rekey(m, step_dir, durable)
        extents = object_extents(m)
        return [(m.objects[i], out.objects[i], extents[i])
                for i in _own_indices(own, m.objects, object_writers(m), rank)]
    if part is None:
        raise RuntimeError(f"{own.where(step_dir)}: neither a commit record of host {rank} nor a manifest")
    return [(k, rekey_one(k, int(i), step_dir, durable), stored_extents(ex))
            for k, i, ex in zip(part.objects, part.extra["indices"], part.extra["extents"], strict=True)]


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
