"""The ``ckptio`` command: bench, ls, inspect, verify, gc, cp, convert.

    ckptio cp SRC DST [--step N] [--dst-step N] [--json]
    ckptio convert SRC DST --from dcp|orbax|ckptio --to ckptio|dcp|orbax [--step N] [--json]

``cp`` copies a committed checkpoint between any two backends (``/path``,
``gs://bucket/x``, ``mem://``, ...) with the engine's parallelism: every
byte is checked against its checksum on the way, the destination's
manifest is committed last. ``convert`` streams a DCP or Orbax checkpoint
directory into ckptio, or a ckptio checkpoint out to one (see
:mod:`ckptio.convert`). ``--step`` is the ckptio side's step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from .engine import run_sync
from .errors import IntegrityError
from .manifest import MANIFEST_NAME, ArrayItem, Manifest
from .store import CheckpointStore
from .verify import verify_checkpoint

__all__ = ["main"]


def _ls(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.url)
    rows = []
    steps: list[int | None] = list(run_sync(store.step_dirs()))
    if run_sync(store._exists(MANIFEST_NAME)):
        steps.insert(0, None)  # a checkpoint saved at the URL itself (step None)
    for step in steps:
        st = run_sync(store.status("" if step is None else str(step)))  # a bad step never stops the listing
        row: dict[str, Any] = {"step": step, "state": st.state, "committed": st.state == "committed"}
        if st.manifest is not None:
            m = st.manifest
            row.update(items=len(m.items), objects=len(m.objects), bytes=_nbytes(m), hosts=m.num_hosts)
        if st.problem:
            row["problem"] = st.problem
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        labels = {"committed": "committed", "damaged": "DAMAGED", "deleting": "being deleted",
                  "in-flight": "in flight (a save is writing it)", "incomplete": "UNCOMMITTED (will be swept)"}
        for r in rows:
            if r["committed"]:
                extra = f"{r['items']} items, {r['objects']} objects, {r['bytes'] / 2**20:.1f} MiB"
            else:
                extra = r.get("problem", "")
            print(f"{'(root)' if r['step'] is None else r['step']:>10}  {labels[r['state']]:<28} {extra}")
    return 0


def _nbytes(m: Manifest) -> int:
    return sum(i.nbytes for i in m.items.values() if isinstance(i, ArrayItem))


def _load(url: str, step: int | None) -> tuple[CheckpointStore, str, Manifest]:
    store = CheckpointStore(url)
    step_dir = run_sync(store.resolve(step))
    return store, step_dir, run_sync(store.read_manifest(step_dir))


def _inspect(args: argparse.Namespace) -> int:
    _store, _step_dir, m = _load(args.url, args.step)
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
    blocks = sum(len(e.crcs) for it in m.items.values() if isinstance(it, ArrayItem) for s in it.shards
                 for e in s.extents)
    doc = {"step": m.step, "checkpoint_id": m.checkpoint_id, "hosts": m.num_hosts, "objects": len(m.objects),
           "bytes": _nbytes(m), "bytes_per_host": per_host, "block_size": m.block_size, "items": items,
           # Every extent carries its blocks' crc32c: status "recorded"; `ckptio verify` re-reads and checks them.
           "checksums": {"algorithm": "crc32c", "block_size": m.block_size, "blocks": blocks, "status": "recorded",
                         "manifest": "sealed"},
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


def _fail(args: argparse.Namespace, e: BaseException, **extra: Any) -> int:
    """Report an error as the command's answer (no traceback): exit status 1."""
    if args.json:
        doc: dict[str, Any] = {"ok": False, "error": str(e), "type": type(e).__name__, **extra}
        if isinstance(e, IntegrityError):
            doc.update(object=e.key, item=e.item)
        print(json.dumps(doc))
    else:
        print(f"FAILED: {e}", file=sys.stderr)
    return 1


def _verify(args: argparse.Namespace) -> int:
    """Re-read every byte of a checkpoint and check every checksum."""
    from tqdm import tqdm

    store, step_dir, m = _load(args.url, args.step)
    total = _nbytes(m)
    with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="verify") as bar:
        try:
            _objects, done = run_sync(verify_checkpoint(store, step_dir, lambda _e, n: bar.update(n)))
        except Exception as e:  # report, don't trace: this is the tool's answer
            return _fail(args, e, url=store.where(step_dir))
        finally:
            run_sync(store.close())
    if args.json:
        doc = {"ok": True, "url": store.where(step_dir), "bytes": done, "objects": len(m.objects)}
        print(json.dumps(doc))
    else:
        print(f"OK: {store.where(step_dir)}: {len(m.objects)} objects, {done / 2**20:.1f} MiB, "
              "every checksum matches")
    return 0


def _cp(args: argparse.Namespace) -> int:
    """Copy a committed checkpoint between two backends, verified, committed at the destination last."""
    from tqdm import tqdm

    from .copy import copy_checkpoint, object_extents

    src, dst = CheckpointStore(args.src), CheckpointStore(args.dst)
    try:
        step_dir = run_sync(src.resolve(args.step))
        m = run_sync(src.read_manifest(step_dir))
        dst_dir = step_dir if args.dst_step is None else str(args.dst_step)
        total = sum(max((off + n for off, n, _c, _i in ex), default=0) for ex in object_extents(m))
        with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="cp") as bar:
            out, stats = run_sync(copy_checkpoint(src, dst, step_dir, dst_step_dir=dst_dir,
                                                  progress=lambda _e, n: bar.update(n)))
    except Exception as e:
        return _fail(args, e, src=args.src, dst=args.dst)
    finally:
        run_sync(src.close())
        run_sync(dst.close())
    doc = {"ok": True, "src": src.where(step_dir), "dst": dst.where(dst_dir), "step": out.step,
           "checkpoint_id": out.checkpoint_id, "objects": len(out.objects), "written": stats.written,
           "kept": stats.kept, "bytes": stats.bytes}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"OK: {doc['src']} -> {doc['dst']}: {stats.written} objects written "
              f"({stats.bytes / 2**20:.1f} MiB), "
              f"{stats.kept} already there; committed")
    return 0


def _convert(args: argparse.Namespace) -> int:
    """Stream a DCP / Orbax checkpoint directory into ckptio, or a ckptio checkpoint out to one."""

    from tqdm import tqdm

    from .convert import convert, source_bytes

    try:
        total = source_bytes(args.src, args.src_format, args.step) if not args.json else None
        with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="convert") as bar:
            res = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                          step=args.step, progress=lambda _e, n: bar.update(n))
    except Exception as e:
        return _fail(args, e, src=args.src, dst=args.dst)
    doc = {"ok": True, **dataclasses.asdict(res)}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"OK: {res.src_format} {res.src} -> {res.dst_format} {res.dst}: {res.items} items, "
              f"{res.bytes / 2**20:.1f} MiB")
    return 0


def _gc(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.url)
    try:
        report = run_sync(store.sweep(args.grace, dry_run=args.dry_run))
    finally:
        run_sync(store.close())
    if args.json:
        print(json.dumps({"ok": True, "dry_run": args.dry_run, **dataclasses.asdict(report)}))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(report.objects)} orphan objects ({report.bytes / 2**20:.1f} MiB), "
          f"{len(report.temporaries)} temporaries, {len(report.intents)} dead saves' intents")
    for k in report.deleted[:50]:
        print(f"  {k}")
    if len(report.deleted) > 50:
        print(f"  ... and {len(report.deleted) - 50} more (--json lists all)")
    if report.finished_deletions:
        print(f"finished interrupted deletions of steps {report.finished_deletions}")
    if report.spared_in_flight:
        print(f"spared {report.spared_in_flight} objects of saves in flight")
    for step_dir in report.damaged:
        print(f"kept the objects of damaged step {step_dir or '(root)'} (see `ckptio ls`)")
    return 0


def _bench(argv: list[str]) -> int:
    from ckptio.bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptio", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    sp.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    sp.add_argument("--json", action="store_true", help="the report as one JSON object")
    sp.set_defaults(fn=_gc)
    sp = sub.add_parser("cp", help="copy a checkpoint between backends (verified, committed last)")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--step", type=int, default=None, help="step to copy (default: the newest committed)")
    sp.add_argument("--dst-step", type=int, default=None, help="step at the destination (default: the same)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=_cp)
    from .convert import FORMATS

    sp = sub.add_parser("convert", help="DCP / Orbax checkpoint directory <-> ckptio, streaming")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--from", dest="src_format", choices=FORMATS, required=True)
    sp.add_argument("--to", dest="dst_format", choices=FORMATS, required=True)
    sp.add_argument("--step", type=int, default=None,
                    help="the ckptio side's step: to read (default: the newest) or to write "
                         "(default: DST itself)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=_convert)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
