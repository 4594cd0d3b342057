"""How a save's hosts record what they wrote, and how the coordinator turns the records into the
manifest: one strategy per kind of job, chosen once, when the save is made (:func:`recording_for`).

- :class:`OneDocument` -- one host: its record is the whole manifest (with pack tables).
- :class:`Fragments` -- several hosts on shared storage: each host writes its own fragment of the
  manifest (format 2) and sends the coordinator only its summary; the coordinator commits a small
  root naming the fragments (an incremental save's references travel in the fragments).
- :class:`CarriedFragments` -- several hosts on host-local stores, where the coordinator cannot read
  the others' fragments: each host's fragment travels to it in the gather
  (:mod:`ckptio.saving.carried_fragments`).
"""

from __future__ import annotations

from typing import Any, Protocol

from ckptio.engine import gather_or_cancel, run_sync
from ckptio.manifest import (
    FragmentRef,
    Manifest,
    build_root,
    fragment_doc,
    fragment_key,
    fragment_ref,
    seal,
    summary_of,
)
from ckptio.manifest.builder import expanded, merged_doc, validated
from ckptio.saving.carried_fragments import carried_save_ids, carried_summary, own_part, write_carried
from ckptio.saving.incremental.hosts import own_base, reference_record, referenced_sizes, with_bases
from ckptio.saving.incremental.plan import reference_items
from ckptio.coord.distributed import Coordinator
from ckptio.engine.layout import ObjectPlan
from ckptio.saving.handle import SaveHandle
from ckptio.saving.incremental.plan import Reuse
from ckptio.store import CheckpointStore
from ckptio.store.transaction import WriteTransaction

__all__ = ["CarriedFragments", "Fragments", "OneDocument", "Recording", "recording_for"]


class SaveJob(Protocol):
    """What a recording reads of its save (:class:`ckptio.saving.job.SaveJob`)."""

    store: CheckpointStore
    coord: Coordinator
    tx: WriteTransaction
    handle: SaveHandle
    step: int | None
    step_dir: str
    where: str
    save_id: str
    head: dict[str, Any]
    plans: list[ObjectPlan]
    reuse: Reuse | None
    base: tuple[str, Manifest] | None


class Recording(Protocol):
    """A job's way of recording and committing."""

    #: Whether each host's record holds the packs' tables (the whole manifest does; fragments hold full items).
    tables: bool

    def record(self, job: SaveJob, record: dict[str, Any]) -> dict[str, Any]:
        """This host's record for the gather, from its own part of the manifest (``record``)."""
        ...

    def manifest(self, job: SaveJob, records: list[dict[str, Any]]) -> tuple[Manifest, bytes]:
        """The coordinator's: every host's record as one manifest, and its bytes as stored."""
        ...


class OneDocument:
    """One host: its record is the manifest."""

    tables = True

    def record(self, job: SaveJob, record: dict[str, Any]) -> dict[str, Any]:
        return record

    def manifest(self, job: SaveJob, records: list[dict[str, Any]]) -> tuple[Manifest, bytes]:
        # The document validated is the one written: no second encoding pass.
        doc = merged_doc(records, job.head, job.where)
        if job.reuse is not None:
            doc = reference_items(doc, job.reuse)
        return validated(doc, job.where), seal(doc)


class Fragments:
    """Several hosts, shared storage: a fragment per host, a root naming them."""

    tables = False

    def record(self, job: SaveJob, record: dict[str, Any]) -> dict[str, Any]:
        record = expanded(record)  # fragments hold full items
        sizes = {p.key: p.size for p in job.plans}
        if job.reuse is not None:  # its references, vouched for as its own objects (ckptio.saving.incremental.hosts)
            bs = job.store.engine.config.block_size
            record = reference_record(record, job.reuse, bs)
            sizes.update(referenced_sizes(job.reuse))
            job.handle.own_base = own_base(record, job.step, job.save_id, bs, job.where)  # type: ignore[arg-type]
        return run_sync(_write_fragment(job.tx, job.step, record, sizes))

    def manifest(self, job: SaveJob, records: list[dict[str, Any]]) -> tuple[Manifest, bytes]:
        root = build_root(records, job.head, job.where)
        data = seal(with_bases(root, records, job.base, job.handle.own_base, job.where))
        return Manifest.from_json(data, job.where), data


class CarriedFragments(Fragments):
    """Several hosts, host-local stores: each fragment carried to the coordinator in the gather."""

    def record(self, job: SaveJob, record: dict[str, Any]) -> dict[str, Any]:
        record = expanded(record)
        # Its own objects, vouched for here as a native save's host does (the coordinator sees only fragments).
        run_sync(job.tx.vouch({p.key: p.size for p in job.plans}))
        job.handle.part = own_part(record, job.store.engine.config.block_size)
        return carried_summary(record, job.step_dir, job.step, job.save_id, job.coord.rank)

    def manifest(self, job: SaveJob, records: list[dict[str, Any]]) -> tuple[Manifest, bytes]:
        # Every host's fragment written here under this save's intent, covering their save ids first.
        job.tx.cover(carried_save_ids(records, job.step_dir, job.where))
        job.handle.part_bases = run_sync(write_carried(job.store.io, records, job.where))
        return super().manifest(job, records)


def recording_for(hosts: int, host_local: bool) -> Recording:
    """The recording of a job of ``hosts`` hosts on a store that is ``host_local`` or shared."""
    if hosts == 1:
        return OneDocument()
    return CarriedFragments() if host_local else Fragments()


async def _write_fragment(
    tx: WriteTransaction, step: int | None, record: dict[str, Any], sizes: dict[str, int],
) -> dict[str, Any]:
    """Write this host's fragment, check that its objects (``sizes``: their least length by key; an
    incremental save's references too) are all there, and return its summary.

    The two run at once: both only need this host's objects written, and on an object store
    under a request budget a check chained after the write costs the save half a round of
    the host's share (the check is a read, the fragment a write: separate slots)."""

    async def fragment() -> FragmentRef | None:
        if not any(it["kind"] == "array" and it["shards"] for it in record["items"].values()):
            return None
        data = fragment_doc(record, step, tx.save_id, tx.host)
        key = fragment_key(tx.step_dir, tx.save_id)
        await tx.store.io.write(key, [memoryview(data)])  # type: ignore[attr-defined]
        await tx.store.io.sync()  # type: ignore[attr-defined]
        return fragment_ref(key, data, tx.host)

    # The coordinator sees only fragments: each host vouches for its own objects before the commit.
    ref, _ = await gather_or_cancel([fragment(), tx.vouch(sizes)])
    return {**summary_of(record, ref, coordinator=tx.host == 0), "bases": sorted(record.get("bases") or {}, key=int)}
