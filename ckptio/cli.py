"""The ``ckptio`` command: bench, ls, inspect, verify, gc."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .engine import run_sync
from .manifest import ArrayItem, Manifest
from .store import CheckpointStore
from .verify import verify_checkpoint, verify_requests

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.url)
    rows = []
    for step in run_sync(store.step_dirs()):
        committed = run_sync(store.is_committed(str(step)))
        row: dict[str, Any] = {"step": step, "committed": committed}
        if committed:
            m = run_sync(store.read_manifest(str(step)))
            row.update(items=len(m.items), objects=len(m.objects), bytes=_nbytes(m), hosts=m.num_hosts)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            state = "committed" if r["committed"] else "UNCOMMITTED (will be swept)"
            extra = f"{r['items']} items, {r['objects']} objects, {r['bytes'] / 2**20:.1f} MiB" if r["committed"] else ""
            print(f"{r['step']:>10}  {state:<28} {extra}")
    return 0


def _nbytes(m: Manifest) -> int:
    return sum(i.nbytes for i in m.items.values() if isinstance(i, ArrayItem))


def _load(url: str, step: int | None) -> tuple[CheckpointStore, str, Manifest]:
    store = CheckpointStore(url)
    step_dir = run_sync(store.resolve(step))
    return store, step_dir, run_sync(store.read_manifest(step_dir))


def _inspect(args: argparse.Namespace) -> int:
    _store, step_dir, m = _load(args.url, args.step)
    items = {}
    per_host: dict[int, int] = {}
    for name, it in m.items.items():
        if isinstance(it, ArrayItem):
            for s in it.shards:
                per_host[s.host] = per_host.get(s.host, 0) + s.size * it.dtype.itemsize
            items[name] = {"dtype": str(it.dtype), "shape": list(it.shape), "origin": it.origin,
                           "shards": [{"offsets": list(s.offsets), "shape": list(s.shape), "host": s.host} for s in it.shards]}
        else:
            items[name] = {"value": repr(it.value)}
    doc = {"step": m.step, "checkpoint_id": m.checkpoint_id, "hosts": m.num_hosts, "objects": len(m.objects),
           "bytes": _nbytes(m), "bytes_per_host": per_host, "block_size": m.block_size, "items": items,
           "metadata": m.metadata}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"step {m.step}  id {m.checkpoint_id}  {m.num_hosts} hosts  {len(m.objects)} objects  {_nbytes(m) / 2**20:.1f} MiB")
    for host, n in sorted(per_host.items()):
        print(f"  host {host}: {n / 2**20:.1f} MiB")
    for name, it in items.items():
        if "value" in it:
            print(f"  {name}: {it['value']}")
        else:
            print(f"  {name}: {it['dtype']}{it['shape']} in {len(it['shards'])} shard(s)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Re-read every byte of a checkpoint and check every checksum."""
    from tqdm import tqdm

    store, step_dir, m = _load(args.url, args.step)
    total = sum(r.rng.length for r in verify_requests(m))
    with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="verify") as bar:
        try:
            run_sync(verify_checkpoint(store, step_dir, lambda _e, n: bar.update(n)))
        except Exception as e:  # report, don't trace: this is the tool's answer
            if args.json:
                print(json.dumps({"ok": False, "error": str(e)}))
            else:
                print(f"FAILED: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"ok": True, "bytes": total, "objects": len(m.objects)}))
    else:
        print(f"OK: {store.where(step_dir)}: {len(m.objects)} objects, {total / 2**20:.1f} MiB, every checksum matches")
    return 0


def _gc(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.url)
    doomed = run_sync(store.sweep(args.grace, dry_run=args.dry_run))
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(doomed)} orphan objects")
    for k in doomed[:50]:
        print(f"  {k}")
    return 0


def _bench(argv: list[str]) -> int:
    from ckptio.bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptio", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("bench", help="IO benchmark against the raw disk, Orbax and DCP (see `ckptio bench -h`)",
                   add_help=False)
    for name, fn, hlp in (("ls", _ls, "list checkpoints"), ("inspect", _inspect, "items, shapes, shards"),
                          ("verify", _verify, "re-read everything and check every checksum")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("url")
        if name != "ls":
            sp.add_argument("--step", type=int, default=None)
        sp.add_argument("--json", action="store_true")
        sp.set_defaults(fn=fn)
    sp = sub.add_parser("gc", help="delete orphan objects of crashed saves")
    sp.add_argument("url")
    sp.add_argument("--grace", type=float, default=3600.0, help="only objects older than this many seconds")
    sp.add_argument("--dry-run", action="store_true")
    sp.set_defaults(fn=_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
