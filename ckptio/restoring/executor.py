"""Executing a read plan: the IO of a restore (reads, checksum verification), then the leaves.

:func:`prepare` does the little IO planning needs (a format-2 manifest's
fragments, a check that the objects are there and as long as the manifest
says) and returns the pure :func:`ckptio.restoring.planner.plan`; :func:`execute`
runs a plan's reads on an engine (every byte verified against its checksum
as it lands) and builds the tree. :func:`restore_checkpoint` is both.

A caller that routes reads (the tiers) stands between the two: it learns
from :meth:`ReadPlan.keys` which objects the plan reads, fetches or routes
them, then executes the plan against the backend that now holds them.

A restore onto accelerators streams (:func:`restore_streamed`): its device-bound leaves are read a
group of about :data:`GROUP_BYTES` at a time, and each group is put on its devices by a second
thread while the next group is read, so that host memory holds a group or two, not the state, and
the host-to-device copies hide behind the reads.
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Iterator
from typing import Any

from ckptio.engine import Engine, Progress, run_sync
from ckptio.manifest import ArrayItem, Manifest
from ckptio.restoring.batches import METADATA_BUDGET, Batched, fragment_cut
from ckptio.restoring.planner import ReadPlan, Selection, plan, select
from ckptio.state.tree import unflatten
from ckptio.store import CheckpointStore

__all__ = ["GROUP_BYTES", "execute", "prepare", "restore_checkpoint", "restore_streamed"]

#: A streamed restore reads its device-bound leaves in groups of about this many bytes (a leaf larger
#: than that is a group of its own): two groups in host memory at most, one read, one being placed.
GROUP_BYTES = 512 << 20


def prepare(store: CheckpointStore, manifest: Manifest, step_dir: str, target: Any = None,
            host: tuple[int, int] | None = None, numbers: list[int] | None = None) -> ReadPlan:
    """The plan of restoring ``manifest`` (of ``store``'s ``step_dir``) as ``target`` asks.

    Reads only what planning needs: a format-2 manifest's fragments holding the
    shards this restore meets, and (unless the store is host-local) the objects'
    sizes, so that nothing is allocated from a manifest whose objects are gone. ``host``: see
    :func:`~ckptio.restoring.planner.plan`; ``numbers``: the fragments the target meets, if known.
    """
    where = store.where(step_dir)
    sel = target if isinstance(target, Selection) else select(manifest, target, where)
    # The shards this restore meets, at hand (a format-2 root reads only the fragments holding them;
    # the boxes are made only then).
    root = manifest
    if numbers is None:
        manifest = run_sync(store.load_fragments(step_dir, root, lambda: sel.boxes(root)))
    elif not root.complete:
        names = {n for n in sel.wanted if isinstance(root.items[n], ArrayItem)}
        manifest = run_sync(store.load_fragment_numbers(step_dir, root, numbers, names))
    if not store.host_local:
        run_sync(store.check_objects(manifest, where))
    return plan(manifest, sel, where=where, max_read=store.engine.config.max_read_size, host=host)


def execute(read_plan: ReadPlan, engine: Engine, progress: Progress | None = None) -> Any:
    """Read every request of ``read_plan`` with ``engine`` (checksums verified), then build the tree.

    IntegrityError / FileNotFoundError if a byte is missing or fails its checksum.
    """
    run_sync(engine.read(read_plan.requests, progress))
    return read_plan.finish()


def restore_checkpoint(
    store: CheckpointStore,
    manifest: Manifest,
    step_dir: str,
    target: Any = None,
    *,
    progress: Progress | None = None,
    host: tuple[int, int] | None = None,
    budget: int = METADATA_BUDGET,
) -> Any:
    """Read ``manifest``'s items (as ``target`` asks) and rebuild the tree (``host``: see ``prepare``).

    A format-2 restore whose fragments' metadata does not fit ``budget`` bytes at once (a
    column block of every array of thousands of hosts) is planned and read in batches of
    fragments (:mod:`ckptio.restoring.batches`): each batch's rows, checksums and requests are
    dropped once its reads are verified, before the next batch is loaded."""
    where = store.where(step_dir)
    sel = select(manifest, target, where)
    if device_bound(sel, manifest):
        return restore_streamed(store, manifest, step_dir, sel, progress=progress, host=host)
    cut = fragment_cut(manifest, sel, budget)
    if cut is None or len(cut) == 1:
        return execute(prepare(store, manifest, step_dir, sel, host, None if cut is None else cut[0]), store.engine,
                       progress)
    plan_ = Batched(manifest, sel, where, host)
    for reqs in plan_.batches(store, step_dir, cut):
        run_sync(store.engine.read(reqs, progress))
        del reqs  # before the next batch is loaded: its checksums and scratch go with it
    return plan_.finish()


def device_bound(sel: Selection, manifest: Manifest) -> list[str]:
    """The array leaves of ``sel`` bound for an accelerator (jax targets on non-CPU devices), if they
    are worth streaming (more than one group of them)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return []
    names = [n for n, t in sel.wanted.items()
             if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) and isinstance(manifest.items.get(n), ArrayItem)
             and _accelerated(getattr(t, "sharding", None))]
    return names if sum(manifest.items[n].nbytes for n in names) > GROUP_BYTES else []


def _accelerated(sharding: Any) -> bool:
    devices = getattr(sharding, "device_set", None)
    return bool(devices) and any(d.platform != "cpu" for d in devices)


def _groups(names: list[str], manifest: Manifest, nbytes: int) -> Iterator[list[str]]:
    group, size = [], 0
    for n in names:
        if group and size + manifest.items[n].nbytes > nbytes:
            yield group
            group, size = [], 0
        group.append(n)
        size += manifest.items[n].nbytes
    if group:
        yield group


def restore_streamed(store: CheckpointStore, manifest: Manifest, step_dir: str, sel: Selection, *,
                     progress: Progress | None = None, host: tuple[int, int] | None = None) -> Any:
    """Restore ``sel`` with its device-bound leaves read group by group, each group placed on its devices
    by a second thread while the next is read (see the module); the other leaves are read last."""
    bound = device_bound(sel, manifest) or list(sel.wanted)
    rest = [n for n in sel.wanted if n not in set(bound)]
    groups = [*_groups(bound, manifest, GROUP_BYTES), *([rest] if rest else [])]
    results: dict[str, Any] = {}
    with concurrent.futures.ThreadPoolExecutor(1, "ckptio-h2d") as placer:
        placing: concurrent.futures.Future[dict[str, Any]] | None = None
        for group in groups:
            sub = Selection({n: sel.wanted[n] for n in group}, [], {"dict": {n: {"leaf": n} for n in group}})
            read_plan = prepare(store, manifest, step_dir, sub, host)
            run_sync(store.engine.read(read_plan.requests, progress))
            if placing is not None:
                results.update(placing.result())  # at most one group placed while the next was read
            placing = placer.submit(read_plan.finish)
            del read_plan  # its host buffers go once placed
        if placing is not None:
            results.update(placing.result())
    return unflatten(sel.structure, results.__getitem__)
