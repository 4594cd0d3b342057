"""The commands that read: ``ls``, ``inspect``, ``verify``."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from ckptio.cli.errors import CliError, kind_of, one_line
from ckptio.cli.where import at_step, nothing_there, open_store, resolve
from ckptio.engine import run_sync
from ckptio.errors import IntegrityError
from ckptio.manage.verify import verify_checkpoint, verify_part
from ckptio.manifest import MANIFEST_NAME, ArrayItem, Manifest
from ckptio.manifest.hoststate import HostStateItem
from ckptio.store import CheckpointStore
from ckptio.store.orbax_steps import OrbaxStep
from ckptio.store.parts import PartRecord
from ckptio.store.urls import local_path

__all__ = ["inspect", "ls", "nbytes", "part_text", "verify"]


def ls(args: argparse.Namespace) -> int:
    at_step(args)
    rows = []
    with open_store(args.url) as store:
        path = local_path(args.url)
        if path is not None and os.path.isfile(path):
            raise CliError("not-found", nothing_there(args.url), url=args.url)
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
                row.update(items=len(m.items), objects=len(m.objects), bytes=nbytes(m), hosts=m.num_hosts,
                           created=m.created)
                if m.object_count() is None:
                    # Format 2: only the root was read (one read per step, as for format 1); the objects
                    # are named in the hosts' fragments, so their count is unknown here, not 0.
                    row.update(objects=None, fragments=len(m.fragments or []))
            if st.orbax is not None:
                row.update(_orbax_row(st.orbax))
            if st.parts:
                row["parts"] = [{"host": r.host, "checkpoint_id": r.checkpoint_id, "hosts": r.num_hosts,
                                 "objects": len(r.objects), "bytes": sum(r.sizes or [])} for r in st.parts]
            if st.problem:
                row["problem"] = st.problem
            rows.append(row)
    if not rows:
        raise CliError("not-found", nothing_there(args.url), url=args.url)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    labels = {"committed": "committed", "damaged": "DAMAGED", "deleting": "being deleted",
              "in-flight": "in flight (a save is writing it)", "incomplete": "UNCOMMITTED (will be swept)",
              "referenced": "deleted, objects referenced", "part": "host part(s) (records)",
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
        elif "parts" in r:
            size = f"{sum(p['bytes'] for p in r['parts']) / 2**20:.1f} MiB"
            when, extra = "-", "; ".join(part_text(p) for p in r["parts"])
        else:
            size, when, extra = "-", "-", r.get("problem", "")
        step = "(root)" if r["step"] is None else r["step"]
        print(f"{step:>10}  {labels[r['state']]:<28} {size:>10}  {when:<19}  {extra}")
    return 0


def part_text(p: dict[str, Any]) -> str:
    """A host's part committed by its record, as ``ls`` and ``verify`` say it."""
    return f"host {p['host']}'s part of checkpoint {p['checkpoint_id']} (of {p['hosts']} hosts)"


def _orbax_row(step: OrbaxStep) -> dict[str, Any]:
    """An Orbax step's part of its ``ls`` row: its items, and the size and time of the step as a whole."""
    items: list[dict[str, Any]] = []
    for it in step.items:
        doc: dict[str, Any] = {"name": it.name, "handler": it.handler or None}
        if it.is_ckptio:
            doc.update(ckptio={"url": it.url, "step": it.step, "state": it.state})
            if it.manifest is not None:
                doc["ckptio"].update(items=len(it.manifest.items), bytes=nbytes(it.manifest),
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


def nbytes(m: Manifest) -> int:
    return sum(i.nbytes for i in m.items.values() if isinstance(i, ArrayItem))


def inspect(args: argparse.Namespace) -> int:
    at_step(args)
    with open_store(args.url) as store:
        _step_dir, m = resolve(store, args.url, args.step)
    items = {}
    per_host: dict[int, int] = {}
    for name, it in m.items.items():
        if isinstance(it, ArrayItem):
            for s in it.shards:
                per_host[s.host] = per_host.get(s.host, 0) + s.size * it.dtype.itemsize
            items[name] = {"dtype": str(it.dtype), "shape": list(it.shape), "origin": it.origin,
                           "shards": [{"offsets": list(s.offsets), "shape": list(s.shape), "host": s.host} for s in it.shards]}
        elif isinstance(it, HostStateItem):  # its size per host: the states themselves may be many
            items[name] = {"per_host": {"hosts": it.num_hosts,
                                        "json_bytes": [len(json.dumps(d, separators=(",", ":"))) for d in it.docs]}}
        else:
            items[name] = {"value": repr(it.value)}
    blocks = sum(len(e.crcs) for it in m.items.values() if isinstance(it, ArrayItem) for s in it.shards
                 for e in s.extents)
    doc = {"step": m.step, "checkpoint_id": m.checkpoint_id, "hosts": m.num_hosts, "objects": len(m.objects),
           "bytes": nbytes(m), "bytes_per_host": per_host, "block_size": m.block_size, "items": items,
           # Every extent carries its blocks' crc32c: status "recorded"; `ckptio verify` re-reads and checks them.
           "checksums": {"algorithm": "crc32c", "block_size": m.block_size, "blocks": blocks, "status": "recorded",
                         "manifest": "sealed"},
           "metadata": m.metadata}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"step {m.step}  id {m.checkpoint_id}  {m.num_hosts} hosts  {len(m.objects)} objects  {nbytes(m) / 2**20:.1f} MiB")
    for host, n in sorted(per_host.items()):
        print(f"  host {host}: {n / 2**20:.1f} MiB")
    for name, it in items.items():
        if "value" in it:
            print(f"  {name}: {it['value']}")
        elif "per_host" in it:
            sizes = it["per_host"]["json_bytes"]
            print(f"  {name}: per-host state of {len(sizes)} host(s), {max(sizes)} bytes of JSON at most")
        else:
            print(f"  {name}: {it['dtype']}{it['shape']} in {len(it['shards'])} shard(s)")
    return 0


def verify(args: argparse.Namespace) -> int:
    """Re-read every byte of a checkpoint and check every checksum."""
    from tqdm import tqdm

    at_step(args)
    with open_store(args.url) as store:
        parts = _parts_only(store, args.step)
        if parts:
            return _verify_parts(args, store, parts)
        step_dir, m = resolve(store, args.url, args.step)
        where = store.where(step_dir)
        with tqdm(total=nbytes(m), unit="B", unit_scale=True, disable=args.json, desc="verify") as bar:
            try:
                _objects, done = run_sync(verify_checkpoint(store, step_dir, lambda _e, n: bar.update(n)))
            except IntegrityError as e:
                raise CliError("damaged", one_line(e, where), url=where, object=e.key, item=e.item) from e
            except Exception as e:
                raise CliError(kind_of(e), one_line(e, where), url=where) from e
    if args.json:
        print(json.dumps({"ok": True, "url": where, "bytes": done, "objects": len(m.objects)}))
    else:
        print(f"OK: {where}: {len(m.objects)} objects, {done / 2**20:.1f} MiB, every checksum matches")
    return 0


def _parts_only(store: CheckpointStore, step: int | None) -> list[PartRecord]:
    """The standing hosts' parts of ``step`` when it has no manifest, only commit records (a tiered job's
    non-coordinator or replica store, :mod:`ckptio.store.parts`); else none."""
    if step is None:
        return []
    st = run_sync(store.status(str(step)))
    return list(st.parts) if st.state == "part" else []


def _verify_parts(args: argparse.Namespace, store: CheckpointStore, parts: list[PartRecord]) -> int:
    """Re-read every object of each part and check it against the extents its record carries."""
    out = []
    for r in parts:
        where = store.where(str(r.step))
        what = part_text({"host": r.host, "checkpoint_id": r.checkpoint_id, "hosts": r.num_hosts})
        try:
            objects, done = run_sync(verify_part(store, r))
        except IntegrityError as e:
            raise CliError("damaged", one_line(e, f"{where}: {what}"), url=where, object=e.key, item=e.item) from e
        except Exception as e:
            raise CliError(kind_of(e), one_line(e, f"{where}: {what}"), url=where) from e
        out.append({"ok": True, "url": where, "host": r.host, "checkpoint_id": r.checkpoint_id,
                    "hosts": r.num_hosts, "objects": objects, "bytes": done})
        if not args.json:
            print(f"OK: {where}: {what}: {objects} objects, {done / 2**20:.1f} MiB, every checksum matches")
    if args.json:
        print(json.dumps(out[0] if len(out) == 1 else out))
    return 0
