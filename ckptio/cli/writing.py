"""The commands that write: ``cp``, ``convert``, ``gc``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ckptio.cli.errors import CliError
from ckptio.cli.reading import nbytes
from ckptio.cli.where import at_step, nothing_there, open_store, refuse_a_file, refuse_memory, resolve
from ckptio.engine import run_sync
from ckptio.store.urls import local_path

__all__ = ["convert", "cp", "gc"]


def _quiet(args: argparse.Namespace) -> bool:
    """No progress bar for ``--json`` or when stderr is not a terminal (a log file gets no redraws)."""
    return bool(args.json) or not sys.stderr.isatty()


def cp(args: argparse.Namespace) -> int:
    """Copy a committed checkpoint between two backends, verified, committed at the destination last."""
    from tqdm import tqdm

    from ckptio.manage.copying import copy_checkpoint, object_extents

    refuse_a_file(args.dst, "destination")
    refuse_memory(args.dst, "destination")
    at_step(args, "src")
    with open_store(args.src) as src, open_store(args.dst) as dst:
        step_dir, m = resolve(src, args.src, args.step)
        dst_dir = step_dir if args.dst_step is None else str(args.dst_step)
        total = sum(max((e[0] + e[1] for e in ex), default=0) for ex in object_extents(m))
        with tqdm(total=total, unit="B", unit_scale=True, disable=_quiet(args), desc="cp") as bar:
            out, stats = run_sync(copy_checkpoint(src, dst, step_dir, dst_step_dir=dst_dir,
                                                  progress=lambda _e, n: bar.update(n)))
        src_where, dst_where = src.where(step_dir), dst.where(dst_dir)
    # Nothing written and nothing found: the destination already held this very checkpoint, committed.
    complete = stats.written == 0 and stats.kept == 0
    doc = {"ok": True, "src": src_where, "dst": dst_where, "step": out.step, "checkpoint_id": out.checkpoint_id,
           "objects": len(out.objects), "written": stats.written, "kept": stats.kept, "bytes": stats.bytes,
           "already_complete": complete}
    if args.json:
        print(json.dumps(doc))
    elif complete:
        print(f"OK: {dst_where} already holds this checkpoint, committed ({len(out.objects)} objects): "
              "already complete, nothing copied")
    else:
        print(f"OK: {src_where} -> {dst_where}: {stats.written} objects written ({stats.bytes / 2**20:.1f} MiB), "
              f"{stats.kept} already there; committed")
    return 0


def convert(args: argparse.Namespace) -> int:
    """Stream a DCP / Orbax checkpoint directory into ckptio, or a ckptio checkpoint out to one."""
    from tqdm import tqdm

    from ckptio.convert import convert as run_convert
    from ckptio.convert import source_bytes

    if args.src_format == "ckptio":
        at_step(args, "src")
    refuse_a_file(args.dst, "destination")
    refuse_memory(args.dst, "destination")
    # Every check that can fail before a byte moves runs before the bar: an error under an empty
    # bar reads as a conversion that started.
    if args.src_format == "ckptio":
        with open_store(args.src) as store:
            total: int | None = nbytes(resolve(store, args.src, args.step)[1])
    else:
        path = local_path(args.src)
        if path is not None and not os.path.lexists(path):
            raise CliError("not-found", f"{args.src} does not exist", url=args.src)
        total = source_bytes(args.src, args.src_format, args.step) if not args.json else None
    with tqdm(total=total, unit="B", unit_scale=True, disable=_quiet(args), desc="convert") as bar:
        res = run_convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                      step=args.step, progress=lambda _e, n: bar.update(n))
    doc = {"ok": True, **dataclasses.asdict(res)}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"OK: {res.src_format} {res.src} -> {res.dst_format} {res.dst}: {res.items} items, "
              f"{res.bytes / 2**20:.1f} MiB")
    return 0


def gc(args: argparse.Namespace) -> int:
    with open_store(args.url) as store:
        path = local_path(args.url)
        if path is not None and not os.path.isdir(path):
            raise CliError("not-found", nothing_there(args.url), url=args.url)
        report = run_sync(store.sweep(args.grace, dry_run=args.dry_run))
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
