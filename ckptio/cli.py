"""The ``ckptio`` command: ls, inspect, verify, gc, cp, convert, bench.

Errors are one line on stderr, ``ckptio: error: <what, naming the URL, step
or object>``, and a distinct exit status (see :data:`EXIT_CODES`); with
``--json`` the error is a JSON object on stdout instead; ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from .engine import run_sync
from .errors import IntegrityError, ManifestError
from .manifest import MANIFEST_NAME, TOMBSTONE_NAME, ArrayItem, Manifest
from .names import parse_fence, parse_intent, parse_object
from .orbax_steps import COMMIT_SUCCESS_NAME, STEP_METADATA_NAME, OrbaxStep
from .store import MAX_STEP, CheckpointStore, check_binding, check_grace
from .urls import file_in_the_way, local_path
from .verify import verify_checkpoint

__all__ = ["EXIT_CODES", "CliError", "main"]

#: Exit statuses: each kind of failure has its own, so scripts can tell them apart.
EXIT_CODES = {
    "ok": 0,
    "failed": 1,       # anything else (the message says what)
    "usage": 2,        # a bad command line or URL (argparse's own status)
    "not-found": 3,    # no checkpoint / step / path there
    "damaged": 4,      # a manifest or an object fails its checks
    "unreachable": 5,  # the storage did not answer (connection refused, timeouts)
    "denied": 6,       # no permission, no credentials, a read-only storage
}

_FSSPEC_PROTOCOLS = ("s3", "s3a", "az", "abfs", "abfss", "adl", "hf", "http", "https", "oss", "r2", "sftp", "webdav")


class CliError(Exception):
    """A failure the command reports as its answer: one line and the exit status of ``kind``."""

    def __init__(self, kind: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


def _kind_of(e: BaseException) -> str:
    """The exit-status kind of an exception raised while a command ran."""
    from ckptio.backends import RetryableError

    if isinstance(e, CliError):
        return e.kind
    if isinstance(e, (IntegrityError, ManifestError)):
        return "damaged"
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return "not-found"
    if isinstance(e, PermissionError):
        return "denied"
    if isinstance(e, (RetryableError, ConnectionError, TimeoutError)) or type(e).__module__.startswith("aiohttp"):
        return "unreachable"
    if isinstance(e, argparse.ArgumentError):
        return "usage"
    return "failed"


def _one_line(e: BaseException, url: str | None) -> str:
    """The exception as one line that names ``url`` (most messages already start with it)."""
    text = " ".join(str(e).split()) or type(e).__name__
    if url and url not in text and not isinstance(e, CliError):
        text = f"{url}: {text}"
    return text


@contextlib.contextmanager
def _store(url: str) -> Iterator[CheckpointStore]:
    """Open ``url``'s store and always close it (an unclosed GCS session warns at exit)."""
    try:
        store = CheckpointStore(url)
    except ValueError as e:
        raise CliError("usage", _scheme_hint(url, str(e))) from e
    try:
        yield store
    finally:
        try:
            run_sync(store.close())
        except Exception:  # the command's own error is the one worth reporting
            pass


def _scheme_hint(url: str, message: str) -> str:
    """An unknown scheme's error, with the fsspec spelling when fsspec has that protocol."""
    if "://" not in url or "no ckptio backend" not in message:
        return message
    scheme = url.split("://", 1)[0].lower()
    known = scheme in _FSSPEC_PROTOCOLS
    try:
        import fsspec

        known = known or scheme in fsspec.available_protocols()
    except ImportError:
        pass
    if not known:
        return message
    return f"{message}. For {scheme}:// through fsspec use fsspec+{url} (pip install 'ckptio[fsspec]' and its package)"


def _nothing_there(url: str) -> str:
    """Why ``ls`` found no checkpoint under ``url``, as precisely as the storage allows."""
    path = local_path(url)
    if path is not None:
        if not os.path.lexists(path):
            return f"{url} does not exist"
        if not os.path.isdir(path):
            return f"{url} is a file, not a checkpoint directory"
        return f"{url} holds no ckptio checkpoint (no step directory with a {MANIFEST_NAME}, none at the top)"
    return f"no ckptio checkpoint under {url}"


def _step_dir_url(url: str) -> tuple[str, int] | None:
    """``(root, step)`` when ``url`` names a step directory of a ckptio root (``ck/30``), else None.

    Pointing at a step directory is the natural first guess, and read as a root of its own it
    looks damaged (its manifest's objects lie in step 30 of the root above). It is one if its
    name is a step number and its manifest records that step with every object in it, or, with
    no manifest (a save in flight or crashed, an Orbax step), it holds what ckptio or Orbax
    writes into a step directory. A checkpoint saved at a directory named like a step (its
    manifest records no step) stays a root.
    """
    trimmed = url.rstrip("/")
    prefix, rest = ("", trimmed) if "://" not in trimmed else (trimmed.split("://", 1)[0] + "://",
                                                               trimmed.split("://", 1)[1])
    head, sep, name = rest.rpartition("/")
    if not (name.isdigit() and str(int(name)) == name and int(name) <= MAX_STEP):
        return None
    if not sep:
        if prefix:
            return None  # a bucket (or memory store) named like a number: there is no root above it
        head = "."
    root, step = prefix + (head or "/"), int(name)
    path = local_path(trimmed)
    if path is not None and not os.path.isdir(path):
        return None
    with _store(trimmed) as store:
        try:
            data: bytes | None = run_sync(store.backend.read(MANIFEST_NAME))
        except FileNotFoundError:
            data = None
        except OSError:
            return None  # unreadable: the command run as given says why, naming the URL
        if data is not None:
            try:
                manifest: Manifest | None = Manifest.from_json(data, url)
            except (ManifestError, IntegrityError):
                manifest = None  # damaged: only what else lies here can tell
            if manifest is not None:
                try:
                    check_binding(manifest, name, url)
                except ManifestError:
                    return None  # a checkpoint of its own (saved at this URL), or one copied here
                return root, step
        children = run_sync(store.backend.list_children(""))
    marks = {STEP_METADATA_NAME, COMMIT_SUCCESS_NAME, TOMBSTONE_NAME}
    for c in children:
        parsed = parse_intent(f"{name}/{c}") or parse_fence(f"{name}/{c}") or parse_object(f"{name}/{c}")
        if c in marks or (parsed is not None and parsed.step_dir == name):
            return root, step
    return None


def _at_step(args: argparse.Namespace, attr: str = "url") -> None:
    """Read a step directory given as ``args.<attr>`` as its root and ``--step`` (:func:`_step_dir_url`)."""
    url = getattr(args, attr)
    found = _step_dir_url(url)
    if found is None:
        return
    root, step = found
    if args.step is not None and args.step != step:
        raise CliError("usage", f"{url} is step {step} of {root}, but --step {args.step} was given: "
                                "give the root with --step, or the step directory alone", url=url)
    setattr(args, attr, root)
    args.step = step


def _refuse_memory(url: str, role: str) -> None:
    """A ``mem://`` destination lives in this process: whatever is written there is gone at exit."""
    if "://" in url and url.split("://", 1)[0].lower() == "mem":
        raise CliError("usage", f"{role} {url} is an in-memory store that vanishes when this command exits: "
                                "give a path or a bucket", url=url)


def _ls(args: argparse.Namespace) -> int:
    _at_step(args)
    rows = []
    with _store(args.url) as store:
        path = local_path(args.url)
        if path is not None and os.path.isfile(path):
            raise CliError("not-found", _nothing_there(args.url), url=args.url)
        steps: list[int | None] = list(run_sync(store.step_dirs()))
        if args.step is not None:
            if args.step not in steps:
                raise CliError("not-found", f"no step {args.step} under {args.url}", url=args.url,
                               step=args.step)
            steps = [args.step]
        elif run_sync(store.exists(MANIFEST_NAME)):
            steps.insert(0, None)  # a checkpoint saved at the URL itself (step None)
        for step in steps:
            st = run_sync(store.status("" if step is None else str(step)))  # a bad step never stops the listing
            row: dict[str, Any] = {"step": step, "state": st.state, "committed": st.state == "committed"}
            if st.manifest is not None:
                m = st.manifest
                row.update(items=len(m.items), objects=len(m.objects), bytes=_nbytes(m), hosts=m.num_hosts,
                           created=m.created)
                if m.object_count() is None:
                    # Format 2: only the root was read (one read per step, as for format 1); the objects
                    # are named in the hosts' fragments, so their count is unknown here, not 0.
                    row.update(objects=None, fragments=len(m.fragments or []))
            if st.orbax is not None:
                row.update(_orbax_row(st.orbax))
            if st.problem:
                row["problem"] = st.problem
            rows.append(row)
    if not rows:
        raise CliError("not-found", _nothing_there(args.url), url=args.url)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    labels = {"committed": "committed", "damaged": "DAMAGED", "deleting": "being deleted",
              "in-flight": "in flight (a save is writing it)", "incomplete": "UNCOMMITTED (will be swept)",
              "unfinalized": "NOT FINALIZED (Orbax's)", "unreadable": "UNREADABLE (permission denied)"}
    print(f"{'step':>10}  {'state':<28} {'size':>10}  {'saved':<19}  what")
    for r in rows:
        if r["committed"]:
            size = f"{r['bytes'] / 2**20:.1f} MiB"
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"])) if r["created"] else "-"
            if "orbax" in r:
                extra = "Orbax step: " + ", ".join(_orbax_item_text(it) for it in r["orbax"]["items"])
            else:
                parts = (f"{r['objects']} objects" if r["objects"] is not None
                         else f"{r['fragments']} host fragments")
                extra = f"{r['items']} items, {parts}, {r['hosts']} host(s)"
        else:
            size, when, extra = "-", "-", r.get("problem", "")
        step = "(root)" if r["step"] is None else r["step"]
        print(f"{step:>10}  {labels[r['state']]:<28} {size:>10}  {when:<19}  {extra}")
    return 0


def _orbax_row(step: OrbaxStep) -> dict[str, Any]:
    """An Orbax step's part of its ``ls`` row: its items, and the size and time of the step as a whole."""
    items: list[dict[str, Any]] = []
    for it in step.items:
        doc: dict[str, Any] = {"name": it.name, "handler": it.handler or None}
        if it.is_ckptio:
            doc.update(ckptio={"url": it.url, "step": it.step, "state": it.state})
            if it.manifest is not None:
                doc["ckptio"].update(items=len(it.manifest.items), bytes=_nbytes(it.manifest),
                                     hosts=it.manifest.num_hosts)
            if it.problem:
                doc["ckptio"]["problem"] = it.problem
        items.append(doc)
    created = step.committed_at or max((it.manifest.created for it in step.items if it.manifest is not None),
                                       default=None)
    hosts = max((it.manifest.num_hosts for it in step.items if it.manifest is not None), default=None)
    return {"orbax": {"finalized": step.finalized, "items": items}, "bytes": step.nbytes, "created": created,
            "hosts": hosts}


def _orbax_item_text(item: dict[str, Any]) -> str:
    """One Orbax item in ``ls``'s last column: ``state (ckptio in place, 2 items, 1.0 MiB)``."""
    if "ckptio" not in item:
        return f"{item['name']} ({item['handler'] or 'unknown handler'})"
    c = item["ckptio"]
    where = "external" if c["step"] is not None else "in place"
    size = f", {c['items']} items, {c['bytes'] / 2**20:.1f} MiB" if "items" in c else ""
    return f"{item['name']} (ckptio {where}{size})"


def _nbytes(m: Manifest) -> int:
    return sum(i.nbytes for i in m.items.values() if isinstance(i, ArrayItem))


def _resolve(store: CheckpointStore, url: str, step: int | None) -> tuple[str, Manifest]:
    """The step directory and manifest of ``step`` (None: the newest intact one) under ``url``."""
    path = local_path(url)
    if path is not None and not os.path.isdir(path):
        raise CliError("not-found", _nothing_there(url), url=url)
    step_dir = run_sync(store.resolve(step))
    return step_dir, run_sync(store.read_manifest(step_dir))


def _inspect(args: argparse.Namespace) -> int:
    _at_step(args)
    with _store(args.url) as store:
        _step_dir, m = _resolve(store, args.url, args.step)
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


def _verify(args: argparse.Namespace) -> int:
    """Re-read every byte of a checkpoint and check every checksum."""
    from tqdm import tqdm

    _at_step(args)
    with _store(args.url) as store:
        step_dir, m = _resolve(store, args.url, args.step)
        where = store.where(step_dir)
        with tqdm(total=_nbytes(m), unit="B", unit_scale=True, disable=args.json, desc="verify") as bar:
            try:
                _objects, done = run_sync(verify_checkpoint(store, step_dir, lambda _e, n: bar.update(n)))
            except IntegrityError as e:
                raise CliError("damaged", _one_line(e, where), url=where, object=e.key, item=e.item) from e
            except Exception as e:
                raise CliError(_kind_of(e), _one_line(e, where), url=where) from e
    if args.json:
        print(json.dumps({"ok": True, "url": where, "bytes": done, "objects": len(m.objects)}))
    else:
        print(f"OK: {where}: {len(m.objects)} objects, {done / 2**20:.1f} MiB, every checksum matches")
    return 0


def _refuse_a_file(url: str, role: str) -> None:
    problem = file_in_the_way(url)
    if problem:
        raise CliError("usage", f"{role} {problem}", url=url)


def _cp(args: argparse.Namespace) -> int:
    """Copy a committed checkpoint between two backends, verified, committed at the destination last."""
    from tqdm import tqdm

    from .copy import copy_checkpoint, object_extents

    _refuse_a_file(args.dst, "destination")
    _refuse_memory(args.dst, "destination")
    _at_step(args, "src")
    with _store(args.src) as src, _store(args.dst) as dst:
        step_dir, m = _resolve(src, args.src, args.step)
        dst_dir = step_dir if args.dst_step is None else str(args.dst_step)
        total = sum(max((off + n for off, n, _c, _i in ex), default=0) for ex in object_extents(m))
        with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="cp") as bar:
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


def _convert(args: argparse.Namespace) -> int:
    """Stream a DCP / Orbax checkpoint directory into ckptio, or a ckptio checkpoint out to one."""
    from tqdm import tqdm

    from .convert import convert, source_bytes

    if args.src_format == "ckptio":
        _at_step(args, "src")
    _refuse_a_file(args.dst, "destination")
    _refuse_memory(args.dst, "destination")
    # Every check that can fail before a byte moves runs before the bar: an error under an empty
    # bar reads as a conversion that started.
    if args.src_format == "ckptio":
        with _store(args.src) as store:
            total: int | None = _nbytes(_resolve(store, args.src, args.step)[1])
    else:
        path = local_path(args.src)
        if path is not None and not os.path.lexists(path):
            raise CliError("not-found", f"{args.src} does not exist", url=args.src)
        total = source_bytes(args.src, args.src_format, args.step) if not args.json else None
    with tqdm(total=total, unit="B", unit_scale=True, disable=args.json, desc="convert") as bar:
        res = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                      step=args.step, progress=lambda _e, n: bar.update(n))
    doc = {"ok": True, **dataclasses.asdict(res)}
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"OK: {res.src_format} {res.src} -> {res.dst_format} {res.dst}: {res.items} items, "
              f"{res.bytes / 2**20:.1f} MiB")
    return 0


def _gc(args: argparse.Namespace) -> int:
    with _store(args.url) as store:
        path = local_path(args.url)
        if path is not None and not os.path.isdir(path):
            raise CliError("not-found", _nothing_there(args.url), url=args.url)
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


def _bench(argv: list[str]) -> int:
    from ckptio.bench import main as bench_main

    return bench_main(argv)


def _grace(text: str) -> float:
    """``--grace``: refused as a usage error (one line, exit 2) unless a finite number >= 0."""
    try:
        return check_grace(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse that raises a usage CliError instead of printing and exiting (main reports it)."""

    def error(self, message: str) -> NoReturn:
        raise CliError("usage", f"{message} (see `{self.prog} --help`)")


_EPILOG = """\
URLs: a path or file://PATH (local disk), gs://BUCKET/PREFIX (GCS), mem://NAME, hdml://PATH,
pstore://PATH, fsspec+PROTOCOL://... (any fsspec filesystem, e.g. fsspec+s3://bucket/run).

exit status: 0 ok, 1 failed, 2 usage (bad arguments or URL), 3 not found, 4 damaged
(a manifest or object fails its checks), 5 storage unreachable, 6 permission denied.
Errors are one line, "ckptio: error: ..."; --json prints them as JSON; --debug shows the traceback.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptio`` argument parser (``bench`` has its own: ``ckptio bench --help``)."""
    from . import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the traceback")
    p = _Parser(prog="ckptio", parents=[common], epilog=_EPILOG,
                description="Inspect, verify, copy, convert and clean up ckptio checkpoints; benchmark storage.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ckptio {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("bench", help="IO benchmark against the raw disk, Orbax and DCP (see `ckptio bench --help`)",
                   add_help=False)
    step_dir_note = " {} may also be a step directory (ROOT/N): read as ROOT --step N."
    for name, fn, hlp in (("ls", _ls, "list the steps under URL: state, size, time"),
                          ("inspect", _inspect, "items, shapes, shards of one step"),
                          ("verify", _verify, "re-read everything and check every checksum")):
        description = hlp[0].upper() + hlp[1:] + "." + step_dir_note.format("URL")
        sp = sub.add_parser(name, help=hlp, description=description, parents=[common])
        sp.add_argument("url", metavar="URL")
        if name == "ls":
            sp.add_argument("--step", type=int, default=None,
                            help="list this step only (default: every step)")
        else:
            sp.add_argument("--step", type=int, default=None, help="the step (default: the newest intact one)")
        sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
        sp.set_defaults(fn=fn)
    hlp = "delete what crashed saves left (orphan objects, temporaries, dead intents)"
    sp = sub.add_parser("gc", help=hlp, parents=[common], description=(
        f"{hlp[0].upper()}{hlp[1:]} under the root URL. Deletes only keys ckptio writes, never an object a "
        "committed checkpoint names or a live save announced; a damaged step's objects are kept. "
        "Orbax step directories are left to Orbax."))
    sp.add_argument("url", metavar="URL")
    sp.add_argument("--grace", type=_grace, default=3600.0,
                    help="only objects older than this many seconds (default: %(default)g)")
    sp.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    sp.add_argument("--json", action="store_true", help="the report as one JSON object")
    sp.set_defaults(fn=_gc)
    hlp = "copy a checkpoint between backends (verified, committed last)"
    sp = sub.add_parser("cp", help=hlp, parents=[common], description=(
        "Copy one committed checkpoint from SRC to DST (any two backends): every object is verified "
        "against its checksums on the way, the manifest is committed at DST last, and a copy that was "
        "interrupted resumes." + step_dir_note.format("SRC")))
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--step", type=int, default=None, help="step to copy (default: the newest committed)")
    sp.add_argument("--dst-step", type=int, default=None, help="step at the destination (default: the same)")
    sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
    sp.set_defaults(fn=_cp)
    from .convert import FORMATS

    hlp = "DCP / Orbax checkpoint directory <-> ckptio, streaming"
    sp = sub.add_parser("convert", help=hlp, parents=[common], description=(
        "Convert a PyTorch DCP or Orbax PyTree checkpoint directory into a ckptio checkpoint, or a ckptio "
        "checkpoint out to one, streaming. One side must be ckptio." + step_dir_note.format("A ckptio SRC")))
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--from", dest="src_format", choices=FORMATS, required=True, help="the format of SRC")
    sp.add_argument("--to", dest="dst_format", choices=FORMATS, required=True,
                    help="the format to write DST in")
    sp.add_argument("--step", type=int, default=None,
                    help="the ckptio side's step: to read (default: the newest) or to write "
                         "(default: DST itself)")
    sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
    sp.set_defaults(fn=_convert)
    return p


def _report(e: BaseException, kind: str, url: str | None, as_json: bool) -> int:
    """Print ``e`` as the command's one-line answer (or JSON); return its exit status."""
    message = _one_line(e, url)
    if as_json:
        doc: dict[str, Any] = {"ok": False, "error": message, "kind": kind, "exit": EXIT_CODES[kind],
                               "type": type(e.__cause__ if isinstance(e, CliError) and e.__cause__ else e).__name__}
        if url:
            doc["url"] = url
        if isinstance(e, IntegrityError):
            doc.update(object=e.key, item=e.item)
        if isinstance(e, CliError):
            doc.update({k: v for k, v in e.extra.items() if v is not None})
        print(json.dumps(doc))
    else:
        print(f"ckptio: error: {message}", file=sys.stderr)
    return EXIT_CODES[kind]


def _log_to_stderr(debug: bool) -> None:
    """ckptio's warnings (a damaged step skipped, a read retried) as ``ckptio: warning: ...`` lines."""
    log = logging.getLogger("ckptio")
    if any(getattr(h, "_ckptio_cli", False) for h in log.handlers) or logging.getLogger().handlers:
        return  # the host program (or an earlier call) configured logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("ckptio: %(levelname)s: %(message)s" if not debug else
                                           "%(asctime)s %(name)s %(levelname)s: %(message)s"))
    handler._ckptio_cli = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if debug else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run the ``ckptio`` command; returns its exit status (see :data:`EXIT_CODES`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    debug = "--debug" in argv
    as_json = "--json" in argv
    _log_to_stderr(debug)
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        return _report(e, "usage", None, as_json)
    url = getattr(args, "url", None) or getattr(args, "src", None)
    try:
        return int(args.fn(args))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- a library's BaseException (torch DCP's) is still one line
        if debug:
            raise
        return _report(e, _kind_of(e), url, as_json)


if __name__ == "__main__":
    sys.exit(main())
