"""Executing a read plan: the IO of a restore (reads, checksum verification), then the leaves.

:func:`prepare` does the little IO planning needs (a format-2 manifest's
fragments, a check that the objects are there and as long as the manifest
says) and returns the pure :func:`ckptio.restoring.plan.plan`; :func:`execute`
runs a plan's reads on an engine (every byte verified against its checksum
as it lands) and builds the tree. :func:`restore_checkpoint` is both.

A caller that routes reads (the tiers) stands between the two: it learns
from :meth:`ReadPlan.keys` which objects the plan reads, fetches or routes
them, then executes the plan against the backend that now holds them.
"""

from __future__ import annotations

from typing import Any

from ckptio.engine import Engine, Progress, run_sync
from ckptio.manifest import ArrayItem, Manifest
from ckptio.restoring.batches import METADATA_BUDGET, Batched, fragment_cut
from ckptio.restoring.plan import ReadPlan, Selection, plan, select
from ckptio.store import CheckpointStore

__all__ = ["execute", "prepare", "restore_checkpoint"]


def prepare(store: CheckpointStore, manifest: Manifest, step_dir: str, target: Any = None,
            host: tuple[int, int] | None = None, numbers: list[int] | None = None) -> ReadPlan:
    """The plan of restoring ``manifest`` (of ``store``'s ``step_dir``) as ``target`` asks.

    Reads only what planning needs: a format-2 manifest's fragments holding the
    shards this restore meets, and (unless the store is host-local) the objects'
    sizes, so that nothing is allocated from a manifest whose objects are gone. ``host``: see
    :func:`~ckptio.restoring.plan.plan`; ``numbers``: the fragments the target meets, if known.
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
    cut = fragment_cut(manifest, sel, budget)
    if cut is None or len(cut) == 1:
        return execute(prepare(store, manifest, step_dir, sel, host, None if cut is None else cut[0]), store.engine,
                       progress)
    plan_ = Batched(manifest, sel, where, host)
    for reqs in plan_.batches(store, step_dir, cut):
        run_sync(store.engine.read(reqs, progress))
        del reqs  # before the next batch is loaded: its checksums and scratch go with it
    return plan_.finish()
