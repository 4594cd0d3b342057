"""``ckptio bench --tiers-scale 64,512,4096``: the tiers' per-save coordination and restart planning of a job
of thousands of hosts, simulated in one machine with the tiers' own code.

Every simulated host is played by a :class:`SimGroup`: one host's side of the job's collectives, the
other hosts' contributions taken from precomputed data and the coordinator's broadcasts replayed from
the coordinator's own run. Each part runs in a fresh process (its time and peak RSS are its own):

* **save** -- the fast tier's commit of one step: every host's record built by the real save code
  (``manifest.builder.host_record``), the coordinator's ``collective_verdict`` + ``SaveJob.commit`` into its
  fast tier and the manager's ``_after_save`` (which spreads the step to every host), then one other
  host's side of the same collectives and its ``_after_save``. Bytes received per host per save are what
  its group hands it (its broadcasts); the total per save is the coordinator's gather plus every other
  host's share.
* **restart** -- one host lost (its fast tier empty: a replaced node), every other host holding its own
  copy of the two newest steps and its predecessor's replica of the newest (or, replication one step
  behind, of the step before: the newest then lacks the lost host's shards): the tiers' agreement on the
  plan (``tiers.restore._agree_on_plan``: what every host reports, what it receives, ``plan_restore``) on
  the coordinator, on the lost host and on one other host. Reading each host's holdings from its fast tier
  is stubbed out (IO): it is the same in every case.

Run it from a tree's root with ``PYTHONPATH=.`` to measure that tree's code (the bench drives only names
both old and new trees have).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ckptio.bench.scale import host_record
from ckptio.bench.simhost import in_child, rss_mb
from ckptio.bench.tiers_sim import COLS, DURABLE_STEP, NEWEST, OLDER, SimGroup, objects_of

__all__ = ["SimGroup", "parse_tiers_scale", "render_tiers_scale", "run_tiers_scale"]

#: The restarts planned: replicas of the newest step (it is restored), or of the one before (the newest
#: lacks the lost host's shards: the plan falls back one step).
RESTARTS = {"restart": False, "behind": True}
RESTART_TITLES = {"restart": "replicas of the newest step:", "behind": "replicas one step behind (falls back one):"}


# -- save: the fast tier's commit ----------------------------------------------------------------------------

def _record(hosts: int, shards: int, rank: int) -> dict[str, Any]:
    """Host ``rank``'s record for the fast tier's gather, from the real save code (JSON round-tripped)."""
    return json.loads(json.dumps({"ok": True, **host_record(hosts, shards, rank, str(NEWEST), COLS)}))


def _manager(fast: str, sim: SimGroup) -> Any:
    """A real manager on ``fast``, playing host ``sim.rank`` (no replicators: the simulation has no peers)."""
    from ckptio.tiers import TieredCheckpointManager, TierPolicy

    m = TieredCheckpointManager(fast, None, policy=TierPolicy(peer_replication=False, replicate_every=0))
    m._control = sim
    m.coordinator = sim
    m.rank, m.size = sim.rank, sim.size
    return m


def _own_record(records_path: str, rank: int) -> dict[str, Any]:
    """Host ``rank``'s record (one JSON line of ``records_path``): no host reads any other's."""
    with open(records_path) as f:
        for r, line in enumerate(f):
            if r == rank:
                return json.loads(line)
    raise IndexError(rank)


def _save_side(root: str, records_path: str, hosts: int, rank: int, replay_path: str, out: Any) -> None:
    """Host ``rank``'s side of one fast-tier save after its writes: the verdict (+ commit), ``_after_save``.

    What each host sends the gather is what a save by many hosts to a host-local store sends
    (``ckptio.saving.carried_fragments``: its summary and its sealed fragment), read from ``<records_path>.gather``."""
    from ckptio.coord.collective import collective_verdict
    from ckptio.manifest.builder import expanded
    from ckptio.saving.carried_fragments import own_part
    from ckptio.saving.job import SaveJob
    from ckptio.saving.savestate import SaveState

    with open(records_path + ".gather") as f:
        gathered = json.load(f)
    record = _own_record(records_path, rank)
    replay: list[bytes] = []
    if rank != 0:
        with open(replay_path) as f:
            replay = [bytes.fromhex(x) for x in json.load(f)]
    sim = SimGroup(rank, hosts, gathered, replay)
    mngr = _manager(os.path.join(root, f"fast{rank}"), sim)
    step_dir = str(NEWEST)
    job = SaveJob(mngr.fast, NEWEST, coordinator=sim)
    job.save_id = f"{rank:012x}"
    job.head = {"format": "ckptio", "version": 1, "step": NEWEST, "checkpoint_id": job.save_id, "fence": "1" * 12,
                "created": time.time(), "block_size": 4 << 20, "num_hosts": hosts,
                "tree": {"dict": {m: {"leaf": m} for m in record["items"]}}, "metadata": {}}
    job.tx = mngr.fast.begin_save(step_dir, job.save_id, host=rank, prepare=False)
    job.handle.part = own_part(expanded(record), 4 << 20)
    objects_of(mngr.fast.url, record)  # the part's commit checks its objects are there (no data)
    t0 = time.perf_counter()
    verdict = collective_verdict(sim, gathered[rank], job.commit if rank == 0 else None)
    assert verdict.ok, verdict.error
    t_commit = time.perf_counter() - t0
    job.tx.end(ok=True)
    job.handle.state = SaveState.COMMITTED
    mngr._after_save(job.handle)
    if mngr._hook_error is not None:
        raise mngr._hook_error
    t_all = time.perf_counter() - t0
    # A restart's first step on this host: what it holds (the real scan, of this one committed step).
    from ckptio.store import CheckpointStore
    from ckptio.tiers.peer import holdings

    # Fresh stores, as a restarted process has them: nothing cached from the commit above.
    fast, replica = (CheckpointStore(s.url, host_local=True) for s in (mngr.fast, mngr.replica))
    t1 = time.perf_counter()
    held = holdings(fast, replica, rank)
    t_held = time.perf_counter() - t1
    assert [h.step for h in held] == [NEWEST], held
    if rank == 0:
        with open(replay_path, "w") as f:
            json.dump([b.hex() for b in sim.broadcasts], f)
    manifest_bytes = sum(os.path.getsize(os.path.join(dp, n)) for dp, _d, ns in os.walk(root) for n in ns
                         if n.startswith("ckptio.manifest") and dp.startswith(os.path.join(root, f"fast{rank}")))
    out.put({"commit_s": t_commit, "save_s": t_all, "holdings_s": t_held, "received": sim.received, "sent": sim.sent,
             "rss_mb": rss_mb(), "manifest_bytes": manifest_bytes})


def _sent(record: dict[str, Any], rank: int) -> dict[str, Any]:
    """What host ``rank`` sends the save's gather (``ckptio.saving.carried_fragments``): its summary and sealed fragment."""
    from ckptio.manifest.builder import expanded
    from ckptio.saving.carried_fragments import carried_summary

    return {"ok": True, **carried_summary(expanded(record), str(NEWEST), NEWEST, f"{rank:012x}", rank)}


# -- restart: the plan after a host loss ----------------------------------------------------------------------

def _holdings(hosts: int, lost: int, behind: bool) -> list[dict[str, Any]]:
    """What each host reports at the restart (the lost host: nothing); partner = rank + 1. Replicas
    are of the newest step, or (``behind``) of the one before: the newest is then incomplete."""
    from ckptio.tiers import Holding

    recs = []
    for r in range(hosts):
        hs: list[Holding] = []
        if r != lost:
            hs += [Holding(r, s, f"c{s}", r, hosts, True) for s in (OLDER, NEWEST)]
            if hosts > 1:
                rs = OLDER if behind else NEWEST
                hs.append(Holding(r, rs, f"c{rs}", (r - 1) % hosts, hosts, False))
        recs.append({"holdings": [h.to_json() for h in hs], "durable": [DURABLE_STEP] if r == 0 else []})
    return recs


class _Durable:
    """The durable tier's listing, the only thing the plan asks of it."""

    async def committed_steps(self) -> list[int]:
        return [DURABLE_STEP]


def _plan_side(hosts: int, rank: int, behind: bool, replay_path: str, out: Any) -> None:
    """Host ``rank``'s side of the restart's agreement on the plan, after host ``hosts // 2`` was lost."""
    import ckptio.tiers.restore as tr
    from ckptio.tiers import LOCAL, PEER, TIERS, Holding

    lost = hosts // 2
    recs = _holdings(hosts, lost, behind)
    replay: list[bytes] = []
    if rank != 0:
        with open(replay_path) as f:
            replay = [bytes.fromhex(x) for x in json.load(f)]
    sim = SimGroup(rank, hosts, recs, replay)
    mine = [Holding.from_json(h) for h in recs[rank]["holdings"]]
    tr.holdings = lambda fast, replica, r: list(mine)  # type: ignore[assignment,attr-defined]  (IO stubbed)
    t = tr.HostTiers(sim, None, None, _Durable())  # type: ignore[arg-type]
    rss0 = rss_mb()
    t0 = time.perf_counter()
    plan, _ = tr._agree_on_plan(t, None, TIERS)
    dt = time.perf_counter() - t0
    # What this host then asks of the plan: its source for every writer (the restore's report does so).
    t1 = time.perf_counter()
    sources = {w: plan.source(rank, w) for w in range(hosts)}
    t_sources = time.perf_counter() - t1
    assert plan.step == (OLDER if behind else NEWEST), plan.step
    partner = (lost + 1) % hosts
    assert sources[rank][0] == (PEER if rank == lost else LOCAL), sources[rank]
    if rank == lost:
        assert sources[lost] == (PEER, partner), sources[lost]
    if rank == 0:
        with open(replay_path, "w") as f:
            json.dump([b.hex() for b in sim.broadcasts], f)
    out.put({"plan_s": dt, "sources_s": t_sources, "received": sim.received, "sent": sim.sent,
             "rss_mb": rss_mb(), "rss0_mb": rss0})


# -- the driver ---------------------------------------------------------------------------------------------

def run_tiers_scale(hosts: int, shards: int = 16, parent: str | None = None, save: bool = True,
                    restarts: Sequence[str] = tuple(RESTARTS)) -> dict[str, Any]:
    """One save's fast-tier coordination (unless not ``save``) and the plan of each of ``restarts``
    (names in :data:`RESTARTS`) at ``hosts`` simulated hosts."""
    res: dict[str, Any] = {"hosts": hosts, "shards_per_host": shards}
    with tempfile.TemporaryDirectory(prefix="ckptio-tiers-scale-", dir=parent) as root:
        replay = os.path.join(root, "replay.json")
        if save:
            t0 = time.perf_counter()
            path = os.path.join(root, "records.jsonl")
            gathered = []
            with open(path, "w") as f:
                for r in range(hosts):
                    record = _record(hosts, shards, r)
                    f.write(json.dumps(record) + "\n")
                    gathered.append(_sent(record, r))
            res["records_s"] = time.perf_counter() - t0
            with open(path + ".gather", "w") as f:
                json.dump(gathered, f)
            sizes = [len(json.dumps(g)) for g in gathered]
            del gathered
            coord = in_child(_save_side, root, path, hosts, 0, replay)
            other = in_child(_save_side, root, path, hosts, min(1, hosts - 1), replay) if hosts > 1 else coord
            res.update({
                "manifest_bytes": coord["manifest_bytes"], "gathered_at_coordinator": sum(sizes[1:]),
                "save_commit_s": coord["commit_s"], "save_coordinator_s": coord["save_s"],
                "save_coordinator_rss_mb": coord["rss_mb"], "save_host_s": other["save_s"],
                "save_host_rss_mb": other["rss_mb"], "save_received_per_host": other["received"],
                "holdings_scan_s": other["holdings_s"],
                "save_total": sum(sizes[1:]) + other["received"] * (hosts - 1),
            })
            from ckptio.bench.tiers_restore_scale import restore_side

            for who, rank in (("coordinator", 0), ("host", 1)):
                got = in_child(restore_side, root, hosts, rank, f"{replay}.restore")
                res.update({f"restore_{who}_{k}": v for k, v in got.items()})
            from ckptio.bench.tiers_durable_scale import durable_side, peer_side, prepare_durable

            res.update({f"peer_{k}": v for k, v in in_child(peer_side, root).items()})
            prepare_durable(root, path, hosts)
            res.update({f"durable_{k}": v for k, v in in_child(durable_side, root, hosts).items()})
        lost = hosts // 2
        for case in restarts:
            behind = RESTARTS[case]
            for who, rank in (("coordinator", 0), ("lost", lost), ("host", (lost + 1) % hosts)):
                got = in_child(_plan_side, hosts, rank, behind, f"{replay}.{case}")
                res.update({f"{case}_{who}_{k}": v for k, v in got.items()})
    return res


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def render_tiers_scale(res: dict[str, Any]) -> str:
    h = res["hosts"]
    lines = [f"tiers scale simulation: {h} hosts x {res['shards_per_host']} shards"]
    if "manifest_bytes" in res:
        lines += [
            f"  per save  fast-tier manifest {_mb(res['manifest_bytes'])}; received per non-coordinator "
            f"{_mb(res['save_received_per_host'])}; gathered at coordinator {_mb(res['gathered_at_coordinator'])}; "
            f"total {_mb(res['save_total'])}",
            f"            coordinator commit {res['save_commit_s']:.2f} s (with the after-save hook: {res['save_coordinator_s']:.2f} s), "
            f"RSS {res['save_coordinator_rss_mb']:.0f} MB; other host {res['save_host_s']:.2f} s, "
            f"RSS {res['save_host_rss_mb']:.0f} MB",
            f"  restart   a host's scan of what it holds (one committed step, fresh stores) "
            f"{res['holdings_scan_s']:.2f} s, not part of the plan times below",
        ]
    if "restore_host_cpu_s" in res:
        lines.append("  restore's manifest (same layout)  cpu s   wall s   received       sent   peak RSS  shards of an array")
        for who in ("coordinator", "host"):
            g = lambda k: res[f"restore_{who}_{k}"]  # noqa: E731
            lines.append(f"    {who:<28} {g('cpu_s'):6.2f}  {g('wall_s'):7.2f}  {_mb(g('received')):>9}  "
                         f"{_mb(g('sent')):>9}  {g('rss_mb'):6.0f} MB  {g('shards_at_hand')}")
    if "durable_wall_s" in res:
        lines += [
            f"  durable round at host 0: {res['durable_wall_s']:.2f} s ({res['durable_cpu_s']:.2f} s CPU), RSS "
            f"{res['durable_rss_mb']:.0f} MB; received {_mb(res['durable_received'])}, sent "
            f"{_mb(res['durable_sent'])} (to one other host {_mb(res['durable_to_host'])}); durable manifest "
            f"format {res['durable_format']}, {_mb(res['durable_manifest_bytes'])}",
            f"  peer round, host 0's head to its partner: {_mb(res['peer_sent'])} (before its objects), prepared in "
            f"{res['peer_wall_s']:.2f} s ({res['peer_cpu_s']:.2f} s CPU), RSS {res['peer_rss_mb']:.0f} MB",
        ]
    lines.append(f"  restart, host {h // 2} lost          plan s  sources s   received       sent   peak RSS")
    for case in (c for c in RESTARTS if f"{c}_coordinator_plan_s" in res):
        lines.append(f"   {RESTART_TITLES[case]}")
        for who in ("coordinator", "lost", "host"):
            g = lambda k: res[f"{case}_{who}_{k}"]  # noqa: E731
            lines.append(f"    {who:<28} {g('plan_s'):7.3f}  {g('sources_s'):8.3f}  {_mb(g('received')):>9}  "
                         f"{_mb(g('sent')):>9}  {g('rss_mb'):6.0f} MB")
    return "\n".join(lines)


def parse_tiers_scale(items: Sequence[str]) -> list[int]:
    """``["64", "512"]`` -> ``[64, 512]`` (host counts of at least 2)."""
    try:
        out = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"--tiers-scale wants host counts (e.g. 64,512,4096), got {','.join(items)!r}") from None
    if any(h < 2 for h in out):
        raise ValueError("--tiers-scale: at least 2 hosts (one to lose, one to hold its replica)")
    return out
