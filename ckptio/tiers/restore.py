"""A tiered restore: agree where each writer's objects come from, then route the core restore's read plan there.

Every host reports what it holds to host 0, which plans and broadcasts one
compact :class:`~ckptio.tiers.policy.RestorePlan` (who reads which writer's
objects from which tier); one host broadcasts the manifest, read through its store
(size cap, tombstone, binding and fence checked): a format-2 root without its
fragments, each host then getting from it only the fragments its target meets
(:mod:`ckptio.tiers.rootcast`). Then the core restore's
:class:`~ckptio.restoring.ReadPlan` says which objects this host reads: they
are routed to its own fast tier, its replicas or the durable tier, or
fetched from peers (a collective exchange), and the plan is executed against
that routed view, every byte checked against its checksum.

A restore deletes nothing. It succeeds only once it succeeded on every host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from ckptio.coord.distributed import join_errors
from ckptio.engine import Progress, run_sync
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.manage.copying import object_writers
from ckptio.manifest import Manifest
from ckptio.restoring import execute
from ckptio.restoring.planner import ReadPlan, select
from ckptio.restoring.planner import plan as plan_reads
from ckptio.store import CheckpointStore
from ckptio.tiers.group import PeerGroup
from ckptio.tiers.peer import OBJECT_NAME, RoutedBackend, fetch_from_peers, holdings, object_host
from ckptio.tiers.policy import DURABLE, LOCAL, PEER, Holding, RestorePlan, check_tiers, plan_restore
from ckptio.tiers.rootcast import HostTiers, manifest_for

__all__ = ["HostTiers", "RestoreReport", "restore_from_tiers"]

log = logging.getLogger("ckptio.tiers")


@dataclasses.dataclass
class RestoreReport:
    """What this host's last restore did."""

    step: int
    checkpoint_id: str | None
    #: Per writer host: where its objects come from for this host (``local``, ``peer`` or ``durable``;
    #: ``none`` where the tiers allowed have no copy this host can read).
    sources: dict[int, str]
    #: Bytes read per tier (peer bytes are those received over the network).
    bytes_from: dict[str, int]
    seconds: float
    plan_seconds: float
    fetch_seconds: float


StoreFor = Callable[[int], CheckpointStore]


def restore_from_tiers(
    t: HostTiers, step: int | None, target: Any, tiers: Collection[str], progress: Progress | None
) -> tuple[RestoreReport, Any]:
    """Collective: restore ``step`` (None: the newest complete in some tier) as ``target`` asks.

    Returns this host's report and the restored tree; raises on every host if
    any host failed (its own failure where it failed, RuntimeError elsewhere).
    """
    t0 = time.perf_counter()
    plan, mine = _agree_on_plan(t, step, tiers)
    own_held = any(h.own and (h.step, h.checkpoint_id) == (plan.step, plan.checkpoint_id) for h in mine)

    def holding_store(writer: int) -> CheckpointStore:
        """This host's store with ``writer``'s objects of the step: its own fast tier, or its replicas."""
        return t.fast if writer == t.rank and own_held else t.replica

    routed = RoutedBackend(f"tiers://{t.fast.url}", {})
    manifest = manifest_for(t, plan, holding_store, target, routed)
    t_plan = time.perf_counter() - t0
    # host_local: routed reads reach only the objects this host's plan fetched
    store = CheckpointStore(routed.url, backend=routed, host_local=True)
    failure: BaseException | None = None
    fetch_seconds = 0.0
    out: Any = None
    read_plan: ReadPlan | None = None
    try:
        try:
            read_plan, loaded = _prepare(store, manifest, str(plan.step), target)
        except Exception as e:  # noqa: BLE001 -- carried into the fetch's status round: every host fails alike
            failure, loaded = e, manifest
        t_fetch = time.perf_counter()
        # Collective even where planning failed (no reads, the error carried): a host that skipped it
        # would leave the others waiting in the exchange forever.
        _route_reads(t, plan, loaded, routed, holding_store, read_plan.keys() if read_plan is not None else set(),
                     None if failure is None else f"planning its reads: {type(failure).__name__}: {failure}")
        fetch_seconds = time.perf_counter() - t_fetch
        if read_plan is not None:
            out = execute(read_plan, store.engine, progress)
    except BaseException as e:  # every host must learn it before the step counts as resumed from
        if failure is not None and e.__cause__ is None:
            e.__cause__ = failure
        failure = e
    finally:
        store.engine.close()
    _everywhere(t.group, plan.step, failure)
    writers = range(plan.num_hosts if plan.num_hosts is not None else manifest.num_hosts)
    report = RestoreReport(
        step=plan.step, checkpoint_id=manifest.checkpoint_id,
        sources={w: _tier_of(plan, t.rank, w) for w in writers},
        bytes_from=dict(routed.bytes_from), seconds=time.perf_counter() - t0, plan_seconds=t_plan,
        fetch_seconds=fetch_seconds,
    )
    return report, out


def _prepare(store: CheckpointStore, root: Manifest, step_dir: str, target: Any) -> tuple[ReadPlan, Manifest]:
    """:func:`ckptio.restoring.prepare` on the routed ``store``, also returning the manifest it planned with:
    a format-2 root's fragments for ``target`` loaded (from those the host was sent), whose objects the
    reads are routed by."""
    where = store.where(step_dir)
    sel = select(root, target, where)
    loaded = run_sync(store.load_fragments(step_dir, root, lambda: sel.boxes(root)))
    return plan_reads(loaded, sel, where=where, max_read=store.engine.config.max_read_size), loaded


def _tier_of(plan: RestorePlan, needer: int, writer: int) -> str:
    """Where ``needer`` reads ``writer``'s objects from, for its report (``none``: nowhere allowed)."""
    try:
        return plan.source(needer, writer)[0]
    except CheckpointNotFoundError:
        return "none"


def _agree_on_plan(t: HostTiers, step: int | None, tiers: Collection[str]) -> tuple[RestorePlan, list[Holding]]:
    """The tier plan, the same on every host, and this host's holdings.

    Every host sends host 0 what it holds (a gather: O(its own holdings)); host 0 plans from
    everyone's (:func:`plan_restore`, linear in the holdings) and broadcasts the plan, whose size
    grows with the writers that break its rule (lost hosts, missing replicas), not with the
    job: a non-coordinator receives a few hundred bytes after one host loss, whatever the number
    of hosts. Any host then derives any host's source from it in O(1).
    """
    check_tiers(tiers)  # the same argument on every host: refused everywhere alike, before any collective
    # Nothing before a collective may raise on one host only (the others would wait forever):
    # a host that cannot read its fast tier holds nothing, a durable tier that cannot be listed has nothing.
    mine: list[Holding] = []
    if set(tiers) & {LOCAL, PEER}:
        try:
            mine = holdings(t.fast, t.replica, t.rank)
        except Exception as e:
            log.error("%s: cannot read this host's fast tier, restoring without it: %r", t.fast.url, e)
    rec: dict[str, Any] = {"holdings": [h.to_json() for h in mine], "durable": []}
    if t.rank == 0 and t.durable is not None and DURABLE in tiers:
        try:
            rec["durable"] = run_sync(t.durable.committed_steps())
        except Exception as e:
            log.error("%s: cannot list the durable tier, restoring without it: %r", t.durable.url, e)
    recs = t.group.gather(rec)
    decided: dict[str, Any] | None = None
    if recs is not None:
        try:
            everything = [Holding.from_json(h) for r in recs for h in r["holdings"]]
            decided = {"plan": plan_restore(everything, recs[0]["durable"], t.group.size, step=step,
                                            tiers=tiers).to_json()}
        except CheckpointNotFoundError as e:  # raised on every host below, as itself
            decided = {"not_found": str(e)}
        except Exception as e:  # noqa: BLE001 -- every host must fail alike
            decided = {"error": f"host 0 could not plan the restore: {type(e).__name__}: {e}"}
    decided = t.group.broadcast(decided)
    if "not_found" in decided:
        raise CheckpointNotFoundError(decided["not_found"])
    if "error" in decided:
        raise RuntimeError(decided["error"])
    return RestorePlan.from_json(decided["plan"]), mine


def _everywhere(group: PeerGroup, step: int, failure: BaseException | None) -> None:
    """Raise unless the restore of ``step`` succeeded on every host (this host's own failure first).

    The step counts as resumed from only once every host holds it in memory: a restore that failed
    anywhere leaves the next save's retirement as it was, everywhere. Host 0 decides; the others
    get the failed hosts' one-line reasons (none when all went well).
    """
    why = None if failure is None else f"host {group.rank}: {type(failure).__name__}: {failure}"
    whys = group.gather(why)
    verdict = group.broadcast(join_errors([w for w in whys if w]) if whys is not None else None)
    if failure is not None:
        raise failure
    if verdict:
        raise RuntimeError(f"restore of step {step} failed on another host: {verdict}")


def _route_reads(t: HostTiers, plan: RestorePlan, m: Manifest, routed: RoutedBackend, holding_store: StoreFor,
                 keys: set[str], error: str | None = None) -> None:
    """Route every key the read plan reads; fetch the peer-sourced ones (collective). ``error``: why this
    host has no read plan (it still takes part; every host then raises, naming this host and why)."""
    if plan.manifest_from is None:  # durable only, on every host alike: no exchange
        assert t.durable is not None
        for k in keys:
            routed.route(k, DURABLE, t.durable.backend, k)
        if error is not None:
            raise RuntimeError(f"restore of step {plan.step}: host {t.rank}: {error}")
        return
    from_peers: list[int] = []
    try:
        if error is None:
            from_peers = _route_local(t, plan, m, routed, holding_store, keys)
    except Exception as e:  # carried into the exchange's status round: every host fails alike
        error = f"{type(e).__name__}: {e}"
        from_peers = []
    got = fetch_from_peers(t.group, plan, m, from_peers, holding_store, local_error=error)
    routed.received.update(got)


def _route_local(t: HostTiers, plan: RestorePlan, m: Manifest, routed: RoutedBackend, holding_store: StoreFor,
                 keys: set[str]) -> list[int]:
    """Route local and durable keys; return the indices of the objects to fetch from peers."""
    step_dir = str(plan.step)
    index = {k: i for i, k in enumerate(m.objects)}
    writers = object_writers(m)
    from_peers: list[int] = []
    durable_keys: list[str] = []
    for k in keys:
        w = writers[index[k]]
        if w is None:
            raise IntegrityError(f"{step_dir}: object {k!r} holds no shard but was asked for", key=k)
        tier, _provider = plan.source(t.rank, w)
        if tier == LOCAL:
            routed.route(k, LOCAL, holding_store(w).backend, k)
        elif tier == PEER:
            from_peers.append(index[k])
        else:
            durable_keys.append(k)
    if durable_keys:
        assert t.durable is not None
        for k, there in _durable_keys(t.durable, plan, m, index, durable_keys).items():
            routed.route(k, DURABLE, t.durable.backend, there)
    return from_peers


def _durable_keys(durable: CheckpointStore, plan: RestorePlan, m: Manifest, index: dict[str, int],
                  keys: list[str]) -> dict[str, str]:
    """Where the durable tier holds each of ``keys`` (objects of the fast tiers' ``m``): by index in a whole
    manifest; by the save id, host and number that a copy's key keeps (see ``rootcast.fast_key``) in one
    with only this host's fragments loaded, whose indices are not the job's (of a format-2 copy, only the
    fragments of the writers of ``keys`` are read)."""
    step_dir = str(plan.step)
    there = run_sync(durable.read_manifest(step_dir, shards=False))
    if m.complete or there.checkpoint_id != m.checkpoint_id:  # by index: every object of the copy
        there = there if there.complete else run_sync(durable.load_fragments(step_dir, there, None))
    elif not there.complete:  # a format-2 copy: only the fragments of the writers of ``keys``
        writers = {object_host(k) for k in keys}
        numbers = [f for f, ref in enumerate(there.fragments or []) if ref.host in writers]
        there = run_sync(durable.load_fragment_numbers(step_dir, there, numbers, names=()))
    if there.checkpoint_id != m.checkpoint_id or (m.complete and len(there.objects) != len(m.objects)):
        raise IntegrityError(
            f"step {plan.step}: the durable tier holds checkpoint {there.checkpoint_id}, "
            f"the fast tiers {m.checkpoint_id}: they cannot be mixed", key=step_dir)
    if m.complete:
        return {k: there.objects[index[k]] for k in keys}
    by_name = {_name_of(k): k for k in there.objects}
    out = {}
    for k in keys:
        name = _name_of(k)
        found = by_name.get(name) if name is not None else None
        if found is None:
            raise IntegrityError(f"step {plan.step}: object {k!r} has no copy in the durable tier", key=k)
        out[k] = found
    return out


def _name_of(key: str) -> str | None:
    """What of ``key`` a copy keeps whatever the naming: its last component, ``sid.hHOST-N`` (None: none such)."""
    m = OBJECT_NAME.fullmatch(key.rpartition("/")[2])
    return m.group(0) if m is not None else None
