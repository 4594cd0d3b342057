"""A tiered restore: agree where each writer's objects come from, then route the core restore's read plan there.

Every host reports what it holds to host 0, which plans and broadcasts one
compact :class:`~ckptio.tiers.policy.RestorePlan` (who reads which writer's
objects from which tier); one host broadcasts the manifest, read through its store
(size cap, tombstone, binding and fence checked). Then the core restore's
:class:`~ckptio.restore.ReadPlan` says which objects this host reads: they
are routed to its own fast tier, its replicas or the durable tier, or
fetched from peers (a collective exchange), and the plan is executed against
that routed view, every byte checked against its checksum.

A restore deletes nothing. It succeeds only once it succeeded on every host.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Collection
from typing import Any

from ..copy import object_writers
from ..engine import Progress, run_sync
from ..errors import CheckpointNotFoundError, IntegrityError
from ..manifest import Manifest
from ..restore import execute, prepare
from ..store import CheckpointStore
from .group import PeerGroup
from .peer import RoutedBackend, fetch_from_peers, holdings
from .policy import DURABLE, LOCAL, PEER, Holding, RestorePlan, check_tiers, plan_restore

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


@dataclasses.dataclass(frozen=True)
class HostTiers:
    """One host's tiers at a restore: its stores, and the group it agrees with the other hosts in."""

    group: PeerGroup
    fast: CheckpointStore
    replica: CheckpointStore
    durable: CheckpointStore | None

    @property
    def rank(self) -> int:
        return self.group.rank


StoreFor = Callable[[int], CheckpointStore]

#: The last component of an object's key as every naming of :mod:`ckptio.layout` spells it.
_OBJECT_NAME = re.compile(r"(?P<sid>[^./]+)\.h(?P<host>\d{5,})-(?P<n>\d{5,})")


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

    manifest = _manifest(t, plan, holding_store)
    t_plan = time.perf_counter() - t0
    routed = RoutedBackend(f"tiers://{t.fast.url}", {})
    # host_local: routed reads reach only the objects this host's plan fetched
    store = CheckpointStore(routed.url, backend=routed, host_local=True)
    failure: BaseException | None = None
    fetch_seconds = 0.0
    out: Any = None
    try:
        read_plan = prepare(store, manifest, str(plan.step), target)
        t_fetch = time.perf_counter()
        _route_reads(t, plan, manifest, routed, holding_store, read_plan.keys())
        fetch_seconds = time.perf_counter() - t_fetch
        out = execute(read_plan, store.engine, progress)
    except BaseException as e:  # every host must learn it before the step counts as resumed from
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


def _manifest(t: HostTiers, plan: RestorePlan, holding_store: StoreFor) -> Manifest:
    """The step's manifest on every host: broadcast by the host the plan names (from its copy of host 0's
    part; where no fast tier holds that part, from the durable tier), else the durable tier's.

    The broadcast carries the manifest or the sender's one-line reason why there is none, which every host
    then raises: a restore fails plainly and alike, never on a half-read manifest.
    """
    step_dir = str(plan.step)
    if plan.manifest_from is None:
        assert t.durable is not None
        return run_sync(t.durable.read_manifest(step_dir))
    data = None
    if t.rank == plan.manifest_from:
        try:
            data = b"M" + _manifest_to_send(t, plan, holding_store).to_json()
        except Exception as e:  # noqa: BLE001 -- every host raises it below
            log.error("step %d: cannot read the manifest to broadcast: %r", plan.step, e)
            data = f"Estep {plan.step}: host {t.rank} cannot read the job's manifest: {type(e).__name__}: {e}".encode()
    data = t.group.broadcast_bytes(data, plan.manifest_from)
    if data[:1] != b"M":
        raise CheckpointNotFoundError(data[1:].decode(errors="replace"))
    return Manifest.from_json(data[1:], f"{t.fast.url}/{step_dir} (host {plan.manifest_from})")


def _manifest_to_send(t: HostTiers, plan: RestorePlan, holding_store: StoreFor) -> Manifest:
    """The manifest this host broadcasts: its copy of host 0's part (host 0's own, or its partner's replica),
    which holds the job's manifest; where no fast tier holds that part (host 0 and its partner lost), the
    durable tier's, under the fast tiers' keys (other hosts' fast tiers hold only their own part, #33)."""
    step_dir = str(plan.step)
    if t.rank in plan.holders(0):
        return run_sync(holding_store(0).read_manifest(step_dir, shards=False))
    if t.durable is None or not plan.in_durable:
        raise CheckpointNotFoundError(f"step {plan.step}: host 0's part (the job's manifest) is in no fast tier, and "
                                      "the durable tier does not hold the step")
    there = run_sync(t.durable.read_manifest(step_dir, shards=False))
    if there.checkpoint_id != plan.checkpoint_id:
        raise CheckpointNotFoundError(f"step {plan.step}: the durable tier holds checkpoint {there.checkpoint_id}, "
                                      f"the fast tiers {plan.checkpoint_id}, and host 0's part is in no fast tier")
    return dataclasses.replace(there, objects=[_fast_key(k, step_dir, t.fast, there.num_hosts) for k in there.objects])


def _fast_key(key: str, step_dir: str, fast: CheckpointStore, num_hosts: int) -> str:
    """The key a durable copy's object ``key`` had in the fast tiers: the fast tier's naming of its save id,
    host and number (a durable copy keeps them in its key's last component; every byte read is checked)."""
    m = _OBJECT_NAME.fullmatch(key.rpartition("/")[2])
    if m is None:
        raise IntegrityError(f"{step_dir}: durable object {key!r} is not named as a save names its objects", key=key)
    return fast.naming.object_key(step_dir, m["sid"], int(m["host"]), num_hosts, int(m["n"]))


def _everywhere(group: PeerGroup, step: int, failure: BaseException | None) -> None:
    """Raise unless the restore of ``step`` succeeded on every host (this host's own failure first).

    The step counts as resumed from only once every host holds it in memory: a restore that failed
    anywhere leaves the next save's retirement as it was, everywhere. Host 0 decides; the others
    get one word.
    """
    oks = group.gather(failure is None)
    all_ok = group.broadcast(all(oks) if oks is not None else None)
    if failure is not None:
        raise failure
    if not all_ok:
        raise RuntimeError(f"restore of step {step} failed on another host")


def _route_reads(t: HostTiers, plan: RestorePlan, m: Manifest, routed: RoutedBackend, holding_store: StoreFor,
                 keys: set[str]) -> None:
    """Route every key the read plan reads; fetch the peer-sourced ones (collective)."""
    if plan.manifest_from is None:  # durable only, on every host alike: no exchange
        assert t.durable is not None
        for k in keys:
            routed.route(k, DURABLE, t.durable.backend, k)
        return
    from_peers: list[int] = []
    error: str | None = None
    try:
        from_peers = _route_local(t, plan, m, routed, holding_store, keys)
    except Exception as e:  # carried into the exchange's status round: every host fails alike
        error = f"{type(e).__name__}: {e}"
        from_peers = []
    got = fetch_from_peers(t.group, plan, m, from_peers, holding_store, local_error=error)
    routed.received.update({m.objects[i]: buf for i, buf in got.items()})


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
        there = run_sync(t.durable.read_manifest(step_dir))
        if there.checkpoint_id != m.checkpoint_id or len(there.objects) != len(m.objects):
            raise IntegrityError(
                f"step {plan.step}: the durable tier holds checkpoint {there.checkpoint_id}, "
                f"the fast tiers {m.checkpoint_id}: they cannot be mixed", key=step_dir)
        for k in durable_keys:
            routed.route(k, DURABLE, t.durable.backend, there.objects[index[k]])
    return from_peers
