"""``ckptio.dcp.Writer``: a torch.distributed.checkpoint StorageWriter on the ckptio engine.

Save, in DCP's order of calls:

1. ``prepare_local_plan`` -- the coordinator looks at what is there before
   anyone writes a byte. Without a step the path is the checkpoint, as in
   DCP: ``overwrite=True`` (FileSystemWriter's default) will replace a
   committed one, ``overwrite=False`` raises DCP's own "Checkpoint already
   exists" error. With ``step=`` (a managed root) a committed step is
   refused, as every ckptio save refuses one (first when the Writer is
   made: one plain error in the caller's code, not torch's wrapped one).
2. ``prepare_global_plan`` (coordinator) -- one save id for every rank, and
   each rank's number, so object names follow the store's naming.
3. ``write_data`` (every rank) -- each WriteItem's bytes (a tensor chunk's
   raw C-order bytes, or a planner byte item) become one piece; the layout
   packs them into objects, and the engine writes them all concurrently
   (DCP waits on the returned future at once, so all parallelism is in
   here). Each WriteResult's ``storage_data`` is a :class:`ChunkLocation`.
   ``torch_readable`` (default on a local path): each tensor chunk's bytes
   sit inside the ``torch.save`` frame stock torch reads
   (:mod:`ckptio.dcp._torchsave`); the manifest points at the raw bytes.
4. ``finish`` (coordinator) -- builds a normal ckptio manifest (one array
   item per FQN, one shard per chunk, DCP's Metadata as JSON beside it) and
   commits it last, once: with create-if-absent, or -- replacing a step-less
   checkpoint -- in one atomic write, after which the old checkpoint's
   objects are deleted by the never-lose rules (:mod:`ckptio.dcp._overwrite`).
   Until then the new checkpoint does not exist for any reader. Then (torch
   readable) DCP's pickled ``.metadata`` for stock torch, recorded in the
   manifest by size and sha256 so that deletion can prove it is ckptio's.

FileSystemWriter's options: ``thread_count`` sets the engine's concurrency
(requests in flight; by default the backend's own good concurrency);
``cache_staged_state_dict`` is accepted -- staging always reuses pooled
host buffers (:mod:`ckptio.dcp.stager`); ``_extensions`` (DCP's stream
transforms, e.g. ``ZStandard``) are applied to each item's bytes and
recorded as DCP records them (:mod:`ckptio.dcp._transforms`);
``single_file_per_rank`` and ``per_thread_copy_ahead`` are accepted and have
no effect (the layout packs objects; staging copies everything first);
``sync_files=False`` is accepted but ckptio still makes every object
durable before it commits (the commit rule is not optional).
``serialization_format=SAFETENSORS`` is refused: ckptio stores raw bytes.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptio.backends import split_url
from ckptio.dcp import _overwrite, _torchsave, _transforms
from ckptio.dcp._codec import DCP_VERSION, ChunkLocation, manifest_doc, numpy_view
from ckptio.dcp._location import Located
from ckptio.dcp._stagedsums import StagedSums
from ckptio.dcp._tensorbytes import plain_array
from ckptio.dcp.stager import SHARED_BUFFERS, HostBuffers, stage_state_dict, state_tensors
from ckptio.engine import EngineConfig, gilswitch, run_sync
from ckptio.engine.layout import Naming, Piece, extent_block, pack
from ckptio.manifest import Manifest
from ckptio.saving.options import SaveOptions
from ckptio.saving.writers import sidecar
from ckptio.saving.writers.auto import default_writer_for
from ckptio.saving.writers.base import THREAD_WRITER, Writer as ObjectWriter
from ckptio.store import CheckpointStore
from ckptio.store.transaction import WriteTransaction, new_id
from ckptio.store.urls import file_in_the_way

__all__ = ["Writer"]

log = logging.getLogger("ckptio.dcp")


@dataclasses.dataclass(frozen=True)
class _PlanInfo:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    save_id: str
    rank: int
    world: int


class Writer(Located, StorageWriter, AsyncStager):
    """Save a DCP checkpoint to any ckptio URL (local path, ``mem://``, ``gs://``, ...).

    ``dcp.save(sd, storage_writer=Writer(url))`` makes ``url`` the checkpoint
    (a later save to it replaces it, as DCP's FileSystemWriter does);
    ``Writer(root, step=100)`` writes ``<root>/100`` as the native API would.
    As an ``AsyncStager`` it stages ``dcp.async_save`` state dicts into host
    buffers reused across saves (``buffers``, by default one process-wide
    pool), checksumming each copy meanwhile so that the background write does
    not; it pickles small for the process executor.

    Args:
        url: checkpoint URL or path (a ``checkpoint_id`` given to ``dcp.save`` replaces it).
        step: save as step ``step`` under ``url`` (a committed step is refused, whatever ``overwrite``).
        engine_config: concurrency, byte budget, checksum block size, retries.
        save_options: who writes the objects and the switch interval (:class:`ckptio.saving.options.SaveOptions`).
        naming: object naming (default: the backend's -- hashed on object stores).
        backend_options: options of the backend (e.g. ``{"fsync": False}`` for local).
        buffers: the staging pool for ``async_save``.
        overwrite: replace a committed step-less checkpoint (DCP's default); False raises DCP's error.
        thread_count: the engine's concurrency (default: the backend's).
        cache_staged_state_dict: accepted for FileSystemWriter compatibility (staging always reuses buffers).
        single_file_per_rank, sync_files, per_thread_copy_ahead: accepted, no effect (see the module doc).
        serialization_format: only DCP's ``TORCH_SAVE`` default (ckptio stores raw bytes either way).
        _extensions: DCP stream transforms (``ZStandard``) applied to every item's stored bytes.
        torch_readable: also make the checkpoint readable by stock torch (``FileSystemReader``,
            ``dcp_to_torch_save``): tensor chunks framed as ``torch.save`` records and DCP's ``.metadata``
            (:mod:`ckptio.dcp._torchsave`). None (default): on for a local path, off elsewhere (stock
            torch reads only local paths) and with ``_extensions``; True with either raises.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        step: int | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
        buffers: HostBuffers | None = None,
        overwrite: bool = True,
        thread_count: int | None = None,
        cache_staged_state_dict: bool = False,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        serialization_format: Any = None,
        _extensions: Sequence[Any] | None = None,
        torch_readable: bool | None = None,
        save_options: SaveOptions | None = None,
    ) -> None:
        super().__init__()
        if thread_count is not None:
            if not isinstance(thread_count, int) or thread_count < 1:
                raise ValueError(f"thread_count must be a positive int, got {thread_count!r}")
            engine_config = dataclasses.replace(engine_config or EngineConfig(), concurrency=thread_count)
        if serialization_format is not None and getattr(serialization_format, "value", serialization_format) != (
                "torch_save"):
            raise ValueError(f"ckptio.dcp.Writer stores raw tensor bytes; serialization_format="
                             f"{serialization_format!r} is not supported (use DCP's HF writer for safetensors)")
        _refuse_file(url)
        self._init_location(url, step, engine_config, backend_options, naming)
        self.save_options = save_options or SaveOptions()  # a bad setting fails here, not mid-save
        self._gil_switch = self.save_options.gil_interval()
        if step is not None:
            self._refuse_committed_step()
        sidecar.prestart(self.save_options.writer_name())
        self.buffers = buffers
        self.overwrite = bool(overwrite)
        self.cache_staged_state_dict = bool(cache_staged_state_dict)
        self.extensions = _transforms.check_extensions(_extensions)
        self._want_torch = torch_readable
        self.torch_readable = _torch_readable(torch_readable, url, bool(self.extensions))
        self._replace = False
        self.is_coordinator = False
        self.rank = 0
        self._save_id: str | None = None
        self._tx: WriteTransaction | None = None
        self._staged_sums: StagedSums | None = None  # set by stage(), taken by the next write_data
        self._writer: ObjectWriter | None = None  # the default stage() chose, taken by the next write_data

    def _open(self) -> CheckpointStore:
        """The store, on a local path with ``direct_unaligned=False`` unless the caller chose.

        ``dcp.save`` hands over the caller's tensors, which torch aligns to 64 bytes, not to a page. Each
        large one is laid out in step with its memory (:func:`ckptio.engine.layout.direct_offset`), so O_DIRECT
        writes its pages in place; an object mostly out of step (many small or oddly offset tensors)
        would take every byte through a bounce buffer, and goes through the page cache instead (once
        1.6x slower than stock DCP's buffered write + fsync, issue 35). Staged (``async_save``) buffers
        are page-aligned and go direct.
        """
        options = self._options
        if self._store is None and _local(options.url) and "direct_unaligned" not in (options.backend_options or {}):
            self._store = CheckpointStore(dataclasses.replace(
                options, backend_options={**(options.backend_options or {}), "direct_unaligned": False}))
        return super()._open()

    def _committed_error(self) -> FileExistsError:
        return FileExistsError(
            f"step {self.step} of {self.url} is already committed ({self.checkpoint_id}); ckptio never "
            "overwrites a step of a managed root: save another step, or delete this one first "
            "(CheckpointManager.delete)")

    def _refuse_committed_step(self) -> None:
        """A committed step is refused here, in the caller's code, as one plain error.

        Inside ``dcp.save`` every StorageWriter hook runs under torch's collectives, which wrap any error
        in a ``CheckpointException`` carrying every rank's traceback. Each rank checks for itself (two
        stats); ranks can disagree only if another job commits this very step at this instant (then the
        ranks that went on fail in ``prepare_local_plan``, or wait in torch's collective for the others).
        """
        try:
            committed = run_sync(self._open().is_committed(self.step_dir))
        finally:
            self._close()
        if committed:
            raise self._committed_error()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["buffers"] = None  # the pool stays in the process that stages
        state["_staged_sums"] = None  # so do the staged tensors' checksums
        state["_tx"] = None  # a live intent's heartbeat stays with the process that plans
        state["_writer"] = None  # this process's writer process: another process writes in-process
        return state

    # -- AsyncStager -------------------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict`` into reused host buffers (see :mod:`ckptio.dcp.stager`), checksumming each
        copy on a helper thread meanwhile, for the write to reuse (see :mod:`ckptio.dcp._stagedsums`)."""
        buffers = self.buffers
        if buffers is None and self._for_writer_process(state_dict):
            # Staged straight into memory the writer process maps; it checksums as it writes.
            return stage_state_dict(state_dict, SHARED_BUFFERS)
        sums = StagedSums((self.engine_config or EngineConfig()).block_size)
        staged = stage_state_dict(state_dict, buffers, sums.add)
        sums.wait()
        self._staged_sums = sums
        return staged

    def _for_writer_process(self, state_dict: dict[str, Any]) -> bool:
        """Whether this async save stages for the writer process: one asked for (``writer="sidecar"``),
        or, with no writer asked for, the default's rule (:mod:`ckptio.saving.writers.auto`: a save of at
        least 64 MiB to a local disk) for a state of CPU tensors (accelerator tensors stage into
        pinned memory, in-process). The choice holds for the write that follows."""
        self._writer = None
        if self.save_options.writer_name() == "sidecar":
            return True
        if self.save_options.writer_asked:
            return False

        def nbytes() -> int:  # walked only where the writer process could write (a local disk)
            tensors = state_tensors(state_dict)
            if any(t.device.type != "cpu" for t in tensors):
                return 0  # accelerator tensors: pinned staging, in-process
            return sum(t.numel() * t.element_size() for t in tensors)

        chosen = default_writer_for(self._open(), nbytes, THREAD_WRITER)
        if chosen is THREAD_WRITER:
            return False
        self._writer = chosen
        return True

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    # -- StorageWriter -----------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP's ``reset``: a given ``checkpoint_id`` becomes the checkpoint's URL (a file there is refused)."""
        if checkpoint_id:
            _refuse_file(checkpoint_id)
            self.torch_readable = _torch_readable(self._want_torch, checkpoint_id, bool(self.extensions))
        self._relocate(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            # Without collectives every rank would commit its own partial manifest.
            raise NotImplementedError("ckptio.dcp.Writer needs use_collectives=True: one coordinator commits")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.is_coordinator:
            try:
                committed = run_sync(_overwrite.existing(self._open(), self.step_dir))  # finishes a deletion
            finally:
                self._close()  # write_data may run in another process (async_save's process executor)
            if committed and self.step is not None:
                raise self._committed_error()  # committed since the Writer was made (torch wraps it)
            if committed and not self.overwrite:
                # DCP's own error and words (FileSystemWriter), with the place named.
                raise RuntimeError(f"Checkpoint already exists and self.overwrite=False. ({self.checkpoint_id})")
            if committed == "stock":
                raise _overwrite.refuse_stock(self.checkpoint_id)
            # Only a step-less checkpoint is ever replaced; overwrite=False commits with create-if-absent,
            # so a save that raced in after this check still is not replaced.
            self._replace = self.step is None and self.overwrite
            if committed:
                log.info("%s: a committed checkpoint is there; this save replaces it (overwrite=True)",
                         self.checkpoint_id)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One id for the whole save: in every object's name and in the manifest.
        save_id = self._save_id = new_id()
        # Announced before any rank writes an object; kept fresh until finish() commits.
        self._tx = self._begin(save_id)
        return [dataclasses.replace(p, storage_data=_PlanInfo(save_id, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):  # a caller that skipped the global plan
            info = _PlanInfo(new_id(), self.rank, 1)
        store = self._open()
        try:
            # async_save runs this on a background thread beside the step: ckptio.engine.gilswitch says why
            with gilswitch.shortened(self._gil_switch):
                results = self._write(store, info, plan.items, planner)
        finally:
            if not self.is_coordinator:  # the coordinator still commits in finish()
                self._close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, store: Any, info: _PlanInfo, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        t0 = time.perf_counter()
        pieces, sizes, descs = [], [], []
        # What stage() checksummed, for this save only (a later stage() on this writer makes its own).
        staged, self._staged_sums = self._staged_sums, None
        bs = store.engine.config.block_size
        for i, item in enumerate(items):
            data, d = _transforms.apply(self.extensions, _raw_bytes(item, planner.resolve_data(item)))
            sizes.append(data.nbytes)
            descs.append(d)
            td = item.tensor_data
            # A small chunk of a sharded tensor gets checksum blocks of its own (format 6); a whole or
            # transformed one is always read whole.
            whole = td is None or bool(d) or tuple(td.chunk.sizes) == tuple(td.size)
            block = extent_block(data.nbytes, whole, bs)
            sums = staged.take(data, block or bs) if staged is not None and not d else None
            pieces.append(Piece(str(i), 0, data, block=block, sums=sums))
        key_for = lambda n: store.naming.object_key(self.step_dir, info.save_id, info.rank, info.world, n)  # noqa: E731
        records: dict[int, tuple[str, int, int]] = {}
        # The writer that will write: the one stage() chose by default, else the store's (ckptio.saving.writers.base).
        writer, self._writer = self._writer or self.save_options.writer_for(store), None
        in_place = not writer.copies
        if self.torch_readable:
            plans, records = _torchsave.pack_records(
                [_record(i, item, p) for i, (item, p) in enumerate(zip(items, pieces))],
                store.backend.layout_defaults.object_size, key_for, store.backend.capabilities.alignment, in_place)
        else:
            plans = pack(pieces, object_size=store.backend.layout_defaults.object_size, key_for=key_for,
                         align=store.backend.capabilities.alignment, in_place=in_place)
        written = writer.write(store, plans, None, None, self.checkpoint_id)
        extents: dict[int, list[tuple[Any, ...]]] = {}
        for obj, w in zip(plans, written):
            for e, crcs in zip(obj.extents, w.crcs):
                if e.item == _torchsave.FRAME:
                    continue  # torch's zip frame around a chunk: not in the manifest
                extents.setdefault(int(e.item), []).append(
                    (obj.key, e.offset, e.shard_offset, e.length, tuple(crcs), *([e.block] if e.block else [])))
        log.info("%s: rank %d wrote %d objects, %d bytes (%.3fs)", self.checkpoint_id, info.rank, len(plans),
                 sum(sizes), time.perf_counter() - t0)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=sizes[i],
                storage_data=ChunkLocation(info.rank, sizes[i], tuple(sorted(extents.get(i, []), key=lambda x: x[2])),
                                           descs[i], records.get(i)),
            )
            for i, item in enumerate(items)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with gilswitch.shortened(self._gil_switch):  # the commit's chain
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self._open()
        where = self.checkpoint_id
        try:
            stock = self._torch_metadata(metadata, results)
            doc = manifest_doc(
                metadata, results, step=self.step, save_id=self._save_id or new_id(), created=time.time(),
                block_size=store.engine.config.block_size, num_hosts=len(results),
                modules=list(metadata.storage_meta.modules) if metadata.storage_meta else [],
                companions=[_torchsave.companion_entry(stock)] if stock is not None else None,
            )
            manifest = Manifest.from_doc(doc, where)  # validates: every tensor's chunks tile it once
            tx = self._tx or self._begin(manifest.checkpoint_id)  # a caller that skipped the global plan
            if self._replace:
                run_sync(_overwrite.replace(store, self.step_dir, manifest, stock))
            else:
                tx.commit(manifest)
                if stock is not None:  # after the commit: torch never reads what ckptio does not call committed
                    run_sync(_overwrite.write_companion(store, self.step_dir, stock))  # logs a failure
        except BaseException:
            self._end(ok=False)
            raise
        finally:
            self._close()
        self._end(ok=True)
        # The Metadata dcp.save returns says where each item went, like FileSystemWriter's.
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rr in results for r in rr}
        log.info("%s: committed", where)


    def _torch_metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes | None:
        """DCP's pickled ``.metadata`` for stock torch, or None (not torch-readable, or a rank's chunk is not framed)."""
        if not self.torch_readable:
            return None
        records = {r.index: getattr(r.storage_data, "record", None) for rr in results for r in rr}
        prefix = f"{self.step_dir}/" if self.step_dir else ""
        if any(rec is None or not rec[0].startswith(prefix) for rec in records.values()):
            log.warning("%s: some chunks are not torch.save records under the checkpoint's directory; "
                        "stock torch will not read it (no .metadata)", self.checkpoint_id)
            return None
        return _torchsave.metadata_bytes(metadata, records, lambda key: key[len(prefix):])  # type: ignore[arg-type]

    def _begin(self, save_id: str) -> WriteTransaction:
        """The save's write transaction, on a store of its own that lives until finish() (the hooks' own
        stores are opened and closed per hook); the step was checked by the plans (no prepare)."""
        store = CheckpointStore(self.url, engine_config=self.engine_config, backend_options=self.backend_options)
        self._tx = store.begin_save(self.step_dir, new_id(), covers=[save_id], prepare=False)
        return self._tx

    def _end(self, *, ok: bool) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.end(ok=ok)
            run_sync(tx.store.close())


def _refuse_file(url: str | os.PathLike[str]) -> None:
    """NotADirectoryError naming ``url`` if it, or a directory above it, is a local file.

    Checked when the writer is made (or reset), before any collective: otherwise
    the save fails later, on every rank, as a bare FileNotFoundError /
    FileExistsError about an intent file, wrapped in a CheckpointException.
    """
    problem = file_in_the_way(url)
    if problem:
        raise NotADirectoryError(f"ckptio.dcp.Writer: {problem}")


def _local(url: str | os.PathLike[str]) -> bool:
    return split_url(os.fspath(url))[0] in ("", "file")


def _torch_readable(want: bool | None, url: str | os.PathLike[str], transformed: bool) -> bool:
    """Whether a save to ``url`` is made readable by stock torch (see ``Writer``'s ``torch_readable``)."""
    if want is None:
        return _local(url) and not transformed
    if want and not _local(url):
        raise ValueError(f"torch_readable=True: stock torch reads local paths only, not {os.fspath(url)!r}")
    if want and transformed:
        raise ValueError("torch_readable=True with _extensions: ckptio transforms raw bytes, stock torch "
                         "expects transformed torch.save records")
    return bool(want)


def _record(i: int, item: WriteItem, piece: Piece) -> _torchsave.Record:
    """A WriteItem's bytes as stock torch reads them: a tensor chunk framed as a torch.save record."""
    assert piece.data is not None
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return _torchsave.Record(i, piece.data, block=piece.block, sums=piece.sums)
    head, tail = _torchsave.frame(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
    return _torchsave.Record(i, piece.data, head, tail, piece.block, piece.sums)


def _raw_bytes(item: WriteItem, data: Any) -> memoryview:
    """The bytes one WriteItem stores: a byte item's buffer, or a tensor chunk's C-order bytes."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"{item.index.fqn!r}: the planner resolved a byte item to {type(data).__name__}")
        return data.getbuffer()
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn!r}: the planner resolved a tensor item to {type(data).__name__}")
    expected = tuple(item.tensor_data.chunk.sizes) if item.tensor_data is not None else None
    plain = plain_array(data)  # one torch call, where the general path below makes up to seven
    if plain is not None and (expected is None or plain.shape == expected):
        return memoryview(plain.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if expected is None:
        expected = tuple(t.shape)
    if tuple(t.shape) != expected:
        raise ValueError(f"{item.index.fqn!r}: the planner resolved a {tuple(t.shape)} tensor for a {expected} chunk")
    arr: np.ndarray = numpy_view(t, item.index.fqn).reshape(-1).view(np.uint8)  # names the FQN if refused
    return memoryview(arr)  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
