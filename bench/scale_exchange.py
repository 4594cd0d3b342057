"""``ckptio bench --scale``, the logical-box exchange: one host's planning when hosts send each other boxes.

Beside :mod:`bench.scale`'s plain restore (each host reads the fragments its
target meets and the stored bytes it needs), this plans the same topology
changes as :mod:`ckptio.restoring.boxroute` does: the host reads the root and
the fragments it is responsible for, intersects their shards with every
host's target boxes (a :class:`TargetTable` per array layout, built on the
host, nothing gathered), plans the verified reads of the stored bytes it
sends, and intersects its own target boxes with the root's locators to know
what it receives. No data is read or sent (IO stubbed as in the plain case).

Job totals: the plain restore's is the measured host's storage read times
the hosts (every host of these cases reads alike); the exchange's is the sum,
over every stored shard some target meets, of the bounding box of what the
targets need of it (each read by one host), from the root: exact bytes,
without checksum-block rounding.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["plan_exchange", "targets_of"]


def _new_job(case: str, hosts: int) -> tuple[int, int]:
    """The restoring job's size and the host measured (one that sends and receives)."""
    if case == "half":
        return hosts // 2, hosts // 4
    if case == "double":
        return 2 * hosts, hosts // 2
    return hosts, hosts // 2


def targets_of(case: str, hosts: int, items: dict[str, Any]) -> dict[str, Any]:
    """Every host's target tables in ``case`` (as :func:`bench.scale._boxes` gives one host's),
    one table per array shape, shared."""
    from ckptio.restoring.boxroute import TargetTable

    new, _rank = _new_job(case, hosts)
    made: dict[tuple[int, ...], TargetTable] = {}
    out: dict[str, TargetTable] = {}
    for name, shape in items.items():
        if case == "whole" and name != "layers/0/w":
            continue
        tt = made.get(shape)
        if tt is None:
            tt = made[shape] = _table(case, new, shape)
        out[name] = tt
    return out


def _table(case: str, new: int, shape: tuple[int, ...]) -> Any:
    from ckptio.restoring.boxroute import TargetTable

    rows, cols = shape
    h = np.arange(new, dtype=np.int64)
    zero = np.zeros(new, np.int64)
    if case in ("same", "half", "double"):  # row blocks of rows / new
        per = rows // new
        return TargetTable.from_columns(h, np.column_stack([h * per, zero]), np.column_stack([zero + per, zero + cols]))
    if case == "resharded":
        w = cols // new if cols >= new else 1
        return TargetTable.from_columns(h, np.column_stack([zero, (h * w) % cols]),
                                        np.column_stack([zero + rows, zero + w]))
    return TargetTable.from_columns(h, np.column_stack([zero, zero]), np.column_stack([zero + rows, zero + cols]))


def plan_exchange(root: str, hosts: int, case: str, out: Any) -> None:
    """One host's exchange planning in ``case`` (run in a fresh process by :mod:`bench.scale`)."""
    from ckptio.bench.simhost import counted_store, preload, rss_mb
    from ckptio.engine import run_sync
    from ckptio.manifest import ArrayItem
    from ckptio.restoring.boxroute import apart, incoming, outgoing, responsible
    from ckptio.restoring.reshard import Region, plan_regions

    new, rank = _new_job(case, hosts)
    preload()
    t0, c0 = time.perf_counter(), time.process_time()
    store, meta = counted_store(root)
    step_dir, root_m = run_sync(store.resolve_manifest(1, shards=False))
    arrays = {n: it.shape for n, it in root_m.items.items() if isinstance(it, ArrayItem)}
    every = targets_of(case, hosts, arrays)
    # As ckptio.restore(read_once=True) chooses: arrays no two hosts share, each host reads itself.
    own = apart(root_m.items, every)
    targets = {n: t for n, t in every.items() if n not in own}
    mine = responsible(len(root_m.fragments or []), new, rank) if targets else []
    m = run_sync(store.load_fragment_numbers(step_dir, root_m, mine, names=set(targets))) if targets else root_m
    boxes = {n: every[n].of_host(rank) for n in own}
    m_own = run_sync(store.load_fragments(step_dir, root_m, boxes)) if boxes else root_m
    t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
    sends = outgoing(m.items, targets, rank)
    # What this host reads to send: per stored shard, the bounding box of what the targets need of it.
    wants, sent_bytes, pieces_out = [], 0, 0
    for name, p in sends.items():
        item = m.items[name]
        pieces_out += len(p)
        sent_bytes += int(p.nbytes(item.dtype.itemsize).sum())
        for row in np.unique(p.ref).tolist():
            sel = p.ref == row
            lo, hi = p.lo[sel].min(axis=0), p.hi[sel].max(axis=0)
            wants.append((name, item, Region(tuple(lo.tolist()), np.empty(tuple((hi - lo).tolist()), item.dtype))))
    reqs = plan_regions(wants, m.objects, m.block_size)
    own_wants = [(n, m_own.items[n], Region(o, np.empty(sh, m_own.items[n].dtype))) for n, bs in boxes.items()
                 for o, sh in bs]
    reqs += plan_regions(own_wants, m_own.objects, m_own.block_size)
    t_send = time.perf_counter() - t0 - t_load
    gets = incoming(root_m.items, targets, rank, new)
    # The plan ends here: what follows is the bench's bookkeeping, not the host's restore.
    t_plan, c_plan = time.perf_counter() - t0 - t_load, time.process_time() - c0 - c_load
    received = sum(int(p.nbytes(root_m.items[n].dtype.itemsize).sum()) for n, p in gets.items())
    needed = sum(int(np.prod(s)) * root_m.items[n].dtype.itemsize for n, tt in every.items()
                 for _o, s in tt.of_host(rank))
    out.put({"load_s": t_load, "plan_s": t_plan, "send_plan_s": t_send, "load_cpu_s": c_load, "plan_cpu_s": c_plan,
             "bytes_read": meta[0], "rss_mb": rss_mb(), "fragments": len(mine), "requests": len(reqs),
             "storage_read": sum(r.rng.length for r in reqs), "sent": sent_bytes, "pieces_out": pieces_out,
             "pieces_in": sum(len(p) for p in gets.values()), "received": received, "storage_needed": needed,
             "hosts_new": new, "job_read": _job_read(root_m, every), "own": len(own), "sent_arrays": len(targets)})


def _job_read(root_m: Any, targets: dict[str, Any]) -> int:
    """Stored bytes the whole job reads with the exchange: per stored shard some target meets, the
    bounding box of what the targets need of it (from the root's locators)."""
    from ckptio.restoring.boxroute import meet

    total = 0
    done: dict[tuple[int, int], int] = {}
    for name, tt in targets.items():
        item = root_m.items[name]
        loc, ndim = item.locator, len(item.shape)
        key = (id(loc), id(tt))
        if key not in done:
            rows, _ib, lo, hi = meet(loc[:, 1 : 1 + ndim], loc[:, 1 + ndim :], tt.offsets, tt.shape)
            order = np.argsort(rows, kind="stable")
            rows, lo, hi = rows[order], lo[order], hi[order]
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.zeros(0, np.int64)
            blo = np.minimum.reduceat(lo, starts) if len(rows) else lo
            bhi = np.maximum.reduceat(hi, starts) if len(rows) else hi
            done[key] = int(np.prod(bhi - blo, axis=1, dtype=np.int64).sum())
        total += done[key] * item.dtype.itemsize
    return total


def render_rows(res: dict[str, Any], cases: dict[str, str]) -> list[str]:
    """The exchange's lines of the ``--scale`` report."""
    lines = ["  host restore with read_once=True (arrays no two hosts share: the fragments its boxes meet, read "
             "itself; the others by logical-box exchange: root + the fragments it sends from; plan = the choice + "
             "its sends + reads + what it receives)",
             "  case                        load + plan (wall; CPU)             metadata read  peak RSS  frags  "
             "storage read   pieces out/in      job read: plain -> read_once  arrays own/exchanged"]
    for c, what in cases.items():
        g = lambda k: res[f"x_{c}_{k}"]  # noqa: E731
        plain_job = res[f"{c}_storage_read"] * g("hosts_new")
        lines.append(f"  {what:<27} {g('load_s'):.3f} + {g('plan_s'):.3f} s; {g('load_cpu_s'):.3f} + "
                     f"{g('plan_cpu_s'):.3f} s  {g('bytes_read') / 2**20:9.2f} MiB "
                     f"{g('rss_mb'):6.0f} MB {g('fragments'):5}  {g('storage_read') / 2**20:8.1f} MiB  "
                     f"{g('pieces_out'):>9,}/{g('pieces_in'):<9,} {plain_job / 2**20:10.1f} -> "
                     f"{g('job_read') / 2**20:.1f} MiB  {g('own')}/{g('sent_arrays')}")
    return lines

