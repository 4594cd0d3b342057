"""``ckptio bench --scale HOSTSxSHARDS``: the commit and the per-host restore planning of a job of
thousands of hosts, simulated in one machine with ckptio's own save and restore code.

Each host's record is built by the real save code (``layout.pack`` and ``ckptio.manifest.host_record``, with
block checksums standing in for the engine's), its fragment written to a local root, and its summary
(what it would send the coordinator) JSON round-tripped. The coordinator's commit
(``fragments.build_root`` -> validation -> ``CheckpointStore.commit``) and one host's restore
(root + the fragments its target meets + ``reshard.plan_region``, no data read) each run in a fresh
process, so their time and peak RSS are theirs alone. The state is Llama-70B-like: per host,
SHARDS/4 parameters x (bf16 weight, fp32 master, Adam mu and nu), each row-sharded over the hosts.

What a non-coordinator receives per save is the coordinator's verdict (``{"ok": true}``, 12 bytes)
plus the transport's framing; the real-process tests (tests/test_coordination.py) count it at 2, 4
and 8 processes over gloo and jax.distributed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import resource
import tempfile
import time
from typing import Any

import numpy as np

__all__ = ["run_scale"]

ROWS_PER_HOST, COLS = 8, 4096
KINDS = (("w", "bfloat16"), ("master", "float32"), ("mu", "float32"), ("nu", "float32"))
VERDICT = {"ok": True}


def _host_files(root: str, hosts: int, shards: int, rank: int) -> dict[str, Any]:
    """Host ``rank``'s fragment (written under ``root``) and its summary, from the real save code."""
    import ml_dtypes  # noqa: F401  (bfloat16 by name)

    from ckptio.engine import WrittenObject
    from ckptio.manifest import FragmentRef, fragment_doc, fragment_key, summary_of
    from ckptio.checksum import crc32c
    from ckptio.layout import FlatNaming, Piece, pack
    from ckptio.manifest import host_record as _host_record
    from ckptio.staging import StagedArray

    params = max(1, shards // len(KINDS))
    block = 4 << 20
    staged: dict[str, Any] = {}
    pieces = []
    scratch = memoryview(bytearray(ROWS_PER_HOST * COLS * 4))  # one buffer behind every piece: no data
    for p in range(params):
        for kind, dtype in KINDS:
            dt = np.dtype(dtype)
            name = f"layers/{p}/{kind}"
            nbytes = ROWS_PER_HOST * COLS * dt.itemsize
            shard = ((rank * ROWS_PER_HOST, 0), (ROWS_PER_HOST, COLS), np.empty(0, np.uint8))
            staged[name] = StagedArray(dt, (hosts * ROWS_PER_HOST, COLS), False, "jax", [shard])
            pieces.append(Piece(name, 0, scratch[:nbytes]))
    save_id = f"{rank:012x}"
    plans = pack(pieces, object_size=64 << 20, key_for=lambda n: FlatNaming().object_key("1", save_id, rank, hosts, n))
    written = [WrittenObject(pl.key, pl.size, [[0] * -(-e.length // block) for e in pl.extents]) for pl in plans]
    record = _host_record(staged, plans, written, rank, include_values=rank == 0)
    data = fragment_doc(record, 1, save_id, rank)
    key = fragment_key("1", save_id)
    with open(os.path.join(root, key), "wb") as f:
        f.write(data)
    return json.loads(json.dumps(summary_of(record, FragmentRef(key, len(data), crc32c(data), rank), coordinator=rank == 0)))


def _commit(root: str, summaries_path: str, hosts: int, out: Any) -> None:
    from ckptio.engine import run_sync
    from ckptio.manifest import build_root
    from ckptio.manifest import Manifest, seal
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
    out.put({"commit_s": time.perf_counter() - t0, "commit_rss_mb": _rss_mb(), "root_bytes": len(data)})


def _plan(root: str, rank: int, hosts: int, resharded: bool, out: Any) -> None:
    from ckptio.engine import run_sync
    from ckptio.manifest import ArrayItem
    from ckptio.reshard import Region, plan_regions
    from ckptio.store import CheckpointStore

    t0 = time.perf_counter()
    store = CheckpointStore(root)
    stored = [0]
    read = store.backend.read

    async def counting_read(key: str) -> bytes:
        data = await read(key)
        stored[0] += len(data)
        return data

    store.backend.read = counting_read  # type: ignore[method-assign]
    step_dir, root_m = run_sync(store.resolve_manifest(1, shards=False))
    boxes = {}
    for name, item in root_m.items.items():
        if isinstance(item, ArrayItem):
            rows, cols = item.shape
            if resharded:  # a column block of every parameter: meets every host's rows
                w = cols // hosts if cols >= hosts else 1
                c0 = (rank * w) % cols
                boxes[name] = [((0, c0), (rows, w))]
            else:
                boxes[name] = [((rank * ROWS_PER_HOST, 0), (ROWS_PER_HOST, cols))]
    m = run_sync(store.load_fragments(step_dir, root_m, boxes))
    t_load = time.perf_counter() - t0
    wants = []
    for name, [(off, shape)] in boxes.items():
        item = m.items[name]
        wants.append((name, item, Region(off, np.empty(shape, item.dtype))))  # not touched: planning only
    requests = len(plan_regions(wants, m.objects, m.block_size))  # as restore.plan does
    out.put({"load_s": t_load, "plan_s": time.perf_counter() - t0 - t_load, "requests": requests,
             "bytes_read": stored[0], "rss_mb": _rss_mb()})


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _in_child(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:  # a child that dies (an exception, the OOM killer) must not leave us waiting
        try:
            res: dict[str, Any] = q.get(timeout=1)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"the {target.__name__} simulation died (exit {p.exitcode}); see its traceback above")
    p.join()
    return res


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
        res.update(_in_child(_commit, root, path, hosts))
        frag_dir = os.path.join(root, "1")
        frags = [os.path.getsize(os.path.join(frag_dir, n)) for n in os.listdir(frag_dir) if "fragment" in n]
        res["fragment_bytes_mean"] = int(np.mean(frags))
        rank = hosts // 2
        same = _in_child(_plan, root, rank, hosts, False)
        resh = _in_child(_plan, root, rank, hosts, True)
        res.update({f"same_{k}": v for k, v in same.items() if v is not None})
        res.update({f"resharded_{k}": v for k, v in resh.items() if v is not None})
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
        f"  host restore, same layout  load {res['same_load_s']:.3f} s + plan {res['same_plan_s']:.3f} s, "
        f"read {res['same_bytes_read'] / 2**20:.2f} MiB of metadata, RSS {res['same_rss_mb']:.0f} MB",
        f"  host restore, resharded    load {res['resharded_load_s']:.3f} s + plan {res['resharded_plan_s']:.3f} s, "
        f"read {res['resharded_bytes_read'] / 2**20:.2f} MiB of metadata, RSS {res['resharded_rss_mb']:.0f} MB",
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

