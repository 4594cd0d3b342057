"""``ckptio bench --scale HOSTSxSHARDS``: the commit and the per-host restore planning of a job of
thousands of hosts, simulated in one machine with ckptio's own save and restore code.

Each host's record is built by the real save code (``layout.pack`` and ``ckptio.manifest.host_record``, with
block checksums standing in for the engine's), its fragment written to a local root, and its summary
(what it would send the coordinator) JSON round-tripped. The coordinator's commit
(``fragments.build_root`` -> validation -> ``CheckpointStore.commit``) and one host's restore
(root + the fragments its target meets + ``reshard.plan_regions``, no data read) each run in a fresh
process, so their time and peak RSS are theirs alone: same layout, N -> N/2, N -> 2N, rows -> columns
and one array wanted whole (:data:`CASES`). The state is Llama-70B-like: per host,
SHARDS/4 parameters x (bf16 weight, fp32 master, Adam mu and nu), each row-sharded over the hosts.

What a non-coordinator receives per save is the coordinator's verdict (``{"ok": true}``, 12 bytes)
plus the transport's framing; the real-process tests (tests/coord/test_distributed.py) count it at 2, 4
and 8 processes over gloo and jax.distributed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import numpy as np

from ckptio.bench.scale_exchange import plan_exchange, render_rows
from ckptio.bench.simhost import counted_store, in_child, preload, rss_mb

__all__ = ["run_scale"]

ROWS_PER_HOST, COLS = 8, 4096
KINDS = (("w", "bfloat16"), ("master", "float32"), ("mu", "float32"), ("nu", "float32"))
VERDICT = {"ok": True}


def host_record(hosts: int, shards: int, rank: int, step_dir: str = "1", cols: int = COLS) -> dict[str, Any]:
    """Host ``rank``'s record of a Llama-like state (``shards`` row-sharded pieces, no data), from the real
    save code: staged arrays, ``layout.pack``, block checksums as random as real ones, ``host_record``."""
    import importlib

    from ckptio.engine import WrittenObject
    from ckptio.engine.layout import FlatNaming, Piece, extent_block, pack
    from ckptio.manifest import host_record as _host_record
    from ckptio.state.leaves import StagedArray

    importlib.import_module("ml_dtypes")  # bfloat16 by name
    params = max(1, shards // len(KINDS))
    block = 4 << 20
    staged: dict[str, Any] = {}
    pieces = []
    scratch = memoryview(bytearray(ROWS_PER_HOST * cols * 4))  # one buffer behind every piece: no data
    for p in range(params):
        for kind, dtype in KINDS:
            dt = np.dtype(dtype)
            name = f"layers/{p}/{kind}"
            nbytes = ROWS_PER_HOST * cols * dt.itemsize
            shard = ((rank * ROWS_PER_HOST, 0), (ROWS_PER_HOST, cols), np.empty(0, np.uint8))
            staged[name] = StagedArray(dt, (hosts * ROWS_PER_HOST, cols), False, "jax", [shard])
            pieces.append(Piece(name, 0, scratch[:nbytes], block=extent_block(nbytes, False, block)))
    save_id = f"{rank:012x}"
    plans = pack(pieces, object_size=64 << 20,
                 key_for=lambda n: FlatNaming().object_key(step_dir, save_id, rank, hosts, n))
    # Checksums as random as real ones (zeros would compress away and flatter the metadata sizes).
    rng = np.random.default_rng(rank)
    written = [WrittenObject(pl.key, pl.size, [rng.integers(0, 2**32, -(-e.length // (e.block or block))).tolist()
                                               for e in pl.extents]) for pl in plans]
    return _host_record(staged, plans, written, rank, include_values=rank == 0)


def _host_files(root: str, hosts: int, shards: int, rank: int) -> dict[str, Any]:
    """Host ``rank``'s fragment (written under ``root``) and its summary, from the real save code."""
    from ckptio.manifest import fragment_doc, fragment_key, fragment_ref, summary_of

    record = host_record(hosts, shards, rank)
    save_id = f"{rank:012x}"
    data = fragment_doc(record, 1, save_id, rank)
    key = fragment_key("1", save_id)
    with open(os.path.join(root, key), "wb") as f:
        f.write(data)
    return json.loads(json.dumps(summary_of(record, fragment_ref(key, data, rank), coordinator=rank == 0)))


def _commit(root: str, summaries_path: str, hosts: int, out: Any) -> None:
    from ckptio.engine import run_sync
    from ckptio.manifest import Manifest, build_root, seal
    from ckptio.store import CheckpointStore

    with open(summaries_path) as f:
        summaries = json.load(f)
    t0 = time.perf_counter()
    head = {"format": "ckptio", "step": 1, "checkpoint_id": "0" * 12, "created": time.time(),
            "block_size": 4 << 20, "num_hosts": hosts, "tree": {"dict": {m[0]: {"leaf": m[0]} for m in summaries[0]["meta"]}},
            "metadata": {}}
    data = seal(build_root(summaries, head, root))
    manifest = Manifest.from_json(data, root)
    store = CheckpointStore(root)
    run_sync(store.commit("1", manifest, data))
    out.put({"commit_s": time.perf_counter() - t0, "commit_rss_mb": rss_mb(), "root_bytes": len(data)})


#: The topology changes a host's restore is planned for: name -> what it shows.
CASES = {
    "same": "same layout",
    "half": "N -> N/2 (same axis)",
    "double": "N -> 2N (same axis)",
    "resharded": "rows -> columns",
    "whole": "one array wanted whole",
}


def _boxes(case: str, rank: int, hosts: int, name: str, shape: tuple[int, ...]) -> list[Any]:
    """Host ``rank``'s target box of array ``name`` (``shape``) in ``case``: empty if it restores none."""
    rows, cols = shape
    if case == "same":
        return [((rank * ROWS_PER_HOST, 0), (ROWS_PER_HOST, cols))]
    if case == "half":  # host rank // 2 of a job of hosts / 2: two saved hosts' rows
        r = rank // 2
        return [((r * 2 * ROWS_PER_HOST, 0), (2 * ROWS_PER_HOST, cols))]
    if case == "double":  # host 2 * rank + 1 of a job of 2 * hosts: half a saved host's rows
        half = ROWS_PER_HOST // 2
        return [(((2 * rank + 1) * half, 0), (half, cols))]
    if case == "resharded":  # a column block of every parameter: meets every host's rows
        w = cols // hosts if cols >= hosts else 1
        return [((0, (rank * w) % cols), (rows, w))]
    return [((0, 0), (rows, cols))] if name == "layers/0/w" else []


def _plan(root: str, rank: int, hosts: int, case: str, out: Any) -> None:
    from ckptio.system import gcpause as _gc

    # As ckptio.restore plans (ckptio.restoring.step): with the cyclic collector held off for the
    # burst, whose full collections walking every request made were a third of this plan's CPU.
    with _gc.paused():
        _plan_paused(root, rank, hosts, case, out)


def _plan_paused(root: str, rank: int, hosts: int, case: str, out: Any) -> None:
    from ckptio.engine import run_sync
    from ckptio.manifest import ArrayItem
    from ckptio.restoring.reshard import Region, plan_regions

    preload()
    t0, c0 = time.perf_counter(), time.process_time()
    store, stored = counted_store(root)
    step_dir, root_m = run_sync(store.resolve_manifest(1, shards=False))
    boxes = {}
    for name, item in root_m.items.items():
        if isinstance(item, ArrayItem) and (mine := _boxes(case, rank, hosts, name, item.shape)):
            boxes[name] = mine
    streamed = _streamed(store, step_dir, root_m, boxes, stored, t0, c0)
    if streamed is not None:
        out.put(streamed)
        return
    m = run_sync(store.load_fragments(step_dir, root_m, boxes))
    t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
    load_rss = rss_mb()
    wants, needed = [], 0
    for name, [(off, shape)] in boxes.items():
        item = m.items[name]
        wants.append((name, item, Region(off, np.empty(shape, item.dtype))))  # not touched: planning only
        needed += int(np.prod(shape)) * item.dtype.itemsize
    reqs = plan_regions(wants, m.objects, m.block_size)  # every region at once, as restore.plan does
    out.put({"load_s": t_load, "plan_s": time.perf_counter() - t0 - t_load, "requests": len(reqs),
             "load_cpu_s": c_load, "plan_cpu_s": time.process_time() - c0 - c_load,
             "bytes_read": stored[0], "rss_mb": rss_mb(), "storage_read": sum(r.rng.length for r in reqs),
             "storage_needed": needed, "load_rss_mb": load_rss})


def _streamed(store: Any, step_dir: str, root_m: Any, boxes: dict[str, list[Any]], stored: list[int],
              t0: float, c0: float) -> dict[str, Any] | None:
    """A host's load + plan as ``ckptio.restore`` does it where the fragments' metadata does not
    fit its budget (:mod:`ckptio.restoring.batches`): batch by batch, each batch's requests dropped
    (here unread: no data) before the next batch is loaded. None where the restore plans at once."""
    from ckptio.restoring import Selection
    from ckptio.restoring.batches import METADATA_BUDGET, Batched, fragment_cut
    from ckptio.state.leaves import Sharded

    wanted = {}
    for name, [(off, shape)] in boxes.items():
        item = root_m.items[name]
        wanted[name] = Sharded(item.shape, item.dtype, [(tuple(slice(o, o + s) for o, s in zip(off, shape)), None)])
    sel = Selection(wanted, [], None)
    cut = fragment_cut(root_m, sel, METADATA_BUDGET)
    if cut is None or len(cut) == 1:
        return None
    plan = Batched(root_m, sel, "bench")
    load = [0.0, 0.0]
    load_fragment_numbers = store.load_fragment_numbers

    async def timed(*args: Any, **kw: Any) -> Any:  # the loads' share of the time (the rest plans)
        w, c = time.perf_counter(), time.process_time()
        try:
            return await load_fragment_numbers(*args, **kw)
        finally:
            load[0] += time.perf_counter() - w
            load[1] += time.process_time() - c

    store.load_fragment_numbers = timed
    n_reqs = n_batches = read = 0
    for reqs in plan.batches(store, step_dir, cut, check=False):
        n_reqs, n_batches, read = n_reqs + len(reqs), n_batches + 1, read + sum(r.rng.length for r in reqs)
        del reqs
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    needed = sum(r.dest.nbytes for _n, r in plan.regions)
    return {"load_s": load[0], "plan_s": wall - load[0], "requests": n_reqs, "load_cpu_s": load[1],
            "plan_cpu_s": cpu - load[1], "bytes_read": stored[0], "rss_mb": rss_mb(), "storage_read": read,
            "storage_needed": needed, "load_rss_mb": None, "batches": n_batches}


def run_scale(hosts: int, shards: int, parent: str | None = None) -> dict[str, Any]:
    """Simulate one save's commit and one host's restore planning at ``hosts`` x ``shards``."""
    with tempfile.TemporaryDirectory(prefix="ckptio-scale-", dir=parent) as root:
        os.makedirs(os.path.join(root, "1"))
        t0 = time.perf_counter()
        summaries = [_host_files(root, hosts, shards, r) for r in range(hosts)]
        t_hosts = time.perf_counter() - t0
        path = os.path.join(root, "summaries.json")
        with open(path, "w") as f:
            json.dump(summaries, f)
        sizes = [len(json.dumps(s)) for s in summaries]
        del summaries
        res: dict[str, Any] = {"hosts": hosts, "shards_per_host": shards, "records_s": t_hosts,
                               "summary_bytes_per_host": int(np.mean(sizes)),
                               "gathered_bytes_at_coordinator": sum(sizes),
                               "received_per_non_coordinator": len(json.dumps(VERDICT))}
        res.update(in_child(_commit, root, path, hosts))
        frag_dir = os.path.join(root, "1")
        frags = [os.path.getsize(os.path.join(frag_dir, n)) for n in os.listdir(frag_dir) if "fragment" in n]
        res["fragment_bytes_mean"] = int(np.mean(frags))
        rank = hosts // 2
        for case in CASES:
            got = in_child(_plan, root, rank, hosts, case)
            res.update({f"{case}_{k}": v for k, v in got.items() if v is not None})
            got = in_child(plan_exchange, root, hosts, case)
            res.update({f"x_{case}_{k}": v for k, v in got.items() if v is not None})
        return res


def render(res: dict[str, Any]) -> str:
    h, s = res["hosts"], res["shards_per_host"]
    lines = [
        f"scale simulation: {h} hosts x {s} shards ({h * s:,} shards), format 2 (root + per-host fragments)",
        f"  coordinator commit      {res['commit_s']:.2f} s, peak RSS {res['commit_rss_mb']:.0f} MB",
        f"  root manifest           {res['root_bytes'] / 2**20:.2f} MiB; fragment {res['fragment_bytes_mean'] / 2**10:.1f} KiB "
        f"per host",
        f"  gathered at coordinator {res['gathered_bytes_at_coordinator'] / 2**20:.1f} MiB "
        f"({res['summary_bytes_per_host'] / 2**10:.1f} KiB per host)",
        f"  non-coordinator receives {res['received_per_non_coordinator']} B per save (the verdict) + transport framing",
        "  host restore (per host)     load + plan (wall; CPU)             metadata read  peak RSS  requests  "
        "storage read / needed",
        *(f"  {what:<27} {res[f'{c}_load_s']:.3f} + {res[f'{c}_plan_s']:.3f} s; {res[f'{c}_load_cpu_s']:.3f} + "
          f"{res[f'{c}_plan_cpu_s']:.3f} s  {res[f'{c}_bytes_read'] / 2**20:9.2f} MiB "
          f"{res[f'{c}_rss_mb']:6.0f} MB {res[f'{c}_requests']:9,}  "
          f"{res[f'{c}_storage_read'] / max(res[f'{c}_storage_needed'], 1):.2f}x "
          f"({res[f'{c}_storage_read'] / 2**20:.1f} / {res[f'{c}_storage_needed'] / 2**20:.1f} MiB)"
          + (f", {res[f'{c}_batches']} batches of fragments" if res.get(f"{c}_batches", 1) > 1 else "")
          for c, what in CASES.items()),
        *render_rows(res, CASES),
        f"  (building {h} hosts' records with the save code took {res['records_s']:.1f} s in this one process)",
    ]
    return "\n".join(lines)


def parse_scale(text: str) -> tuple[int, int]:
    """``"4096x256"`` -> ``(4096, 256)``."""
    try:
        hosts, shards = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--scale wants HOSTSxSHARDS (e.g. 4096x256), got {text!r}") from None
    if hosts < 1 or shards < len(KINDS):
        raise ValueError(f"--scale {text!r}: at least 1 host and {len(KINDS)} shards per host")
    return hosts, shards

