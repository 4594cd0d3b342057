"""Write a checkpoint array by array, shard by shard, then commit the manifest last.

:func:`ckptio.save` takes a whole state at once; converters (``ckptio
convert``) and other producers that hold only a piece at a time use a
:class:`StreamWriter` instead::

    w = StreamWriter(store, step=100)
    for name, dtype, shape in arrays:
        w.add_array(name, dtype, shape)
        for offsets, data in shards_of(name):     # one shard in memory at a time
            w.write_shard(name, offsets, data)
    w.add_value("step", 100)
    w.commit()                                    # written -> committed

Shards are packed into objects with :func:`ckptio.engine.layout.pack` and written
by the engine (checksums, retries, concurrency) in batches of about
``batch_bytes``; at most ``inflight_bytes`` of shard data is held between
``write_shard`` and the end of its object's write, so memory stays bounded
however large the checkpoint. The manifest is assembled like a save's host
record and merged/validated by :func:`ckptio.manifest.merge_records` (every array
must be tiled exactly once), then committed with create-if-absent. Until
then the checkpoint does not exist; a crash leaves only orphans for the
sweep. One process writes everything (``num_hosts`` 1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from typing import Any

import numpy as np

from ckptio.engine import Progress, WrittenObject, run_sync, submit
from ckptio.engine.layout import ObjectPlan, Piece, extent_block, pack
from ckptio.manifest import Manifest, ValueItem, array_json, item_to_json, merge_records, shard_json
from ckptio.saving.savestate import SaveState
from ckptio.state.dtypes import check_dtype, encode_dtype
from ckptio.store import CheckpointStore, step_dir_of
from ckptio.store.transaction import new_id

__all__ = ["StreamWriter"]

log = logging.getLogger("ckptio.stream")


class StreamWriter:
    """An incremental writer of one checkpoint (see the module docstring).

    Args:
        store: where to write (its engine, backend and naming are used).
        step: the step to write (``None``: the store's root is the checkpoint).
        batch_bytes: shard bytes gathered before they are packed and sent to the engine.
        inflight_bytes: shard bytes being written at most (plus up to ``batch_bytes`` queued);
            ``write_shard`` blocks until earlier batches are written when it would pass this.
        progress: ``progress("written", nbytes)`` after each object.
    """

    def __init__(
        self,
        store: CheckpointStore,
        step: int | None = None,
        *,
        batch_bytes: int = 64 << 20,
        inflight_bytes: int = 256 << 20,
        progress: Progress | None = None,
    ) -> None:
        self.store = store
        self.step = step
        self.step_dir = step_dir_of(step)
        self.where = store.where(self.step_dir)
        self.save_id = new_id()
        self.state = SaveState.STAGED
        self.batch_bytes = max(1, batch_bytes)
        self.inflight_bytes = max(self.batch_bytes, inflight_bytes)
        self.progress = progress
        self._tx = store.begin_save(self.step_dir, self.save_id)  # before the first object
        self.objects: list[str] = []
        self._items: dict[str, dict[str, Any]] = {}  # manifest JSON of each item, extents filled as written
        self._pending: list[Piece] = []
        self._keep: list[np.ndarray] = []  # the arrays behind the pending pieces
        self._pending_bytes = 0
        self._inflight: collections.deque[
            tuple[concurrent.futures.Future[list[WrittenObject]], list[ObjectPlan], int, int]
        ] = collections.deque()
        self._inflight_total = 0
        self.bytes_written = 0

    # -- declaring and writing -------------------------------------------

    def add_array(
        self, name: str, dtype: Any, shape: tuple[int, ...], *, scalar: bool = False, origin: str = "numpy"
    ) -> None:
        """Declare an array item; its shards follow with :meth:`write_shard`."""
        if name in self._items:
            raise ValueError(f"{self.where}: item {name!r} declared twice")
        dtype = np.dtype(dtype)
        check_dtype(dtype, name)
        # "_dtype" (the dtype itself, for write_shard's checks) is dropped before the manifest is built.
        self._items[name] = {**array_json(encode_dtype(dtype), [int(d) for d in shape], scalar, origin, []),
                             "_dtype": dtype}

    def add_value(self, name: str, value: Any) -> None:
        """A small non-array item (int, float, bool, str, bytes, None), kept in the manifest."""
        if name in self._items:
            raise ValueError(f"{self.where}: item {name!r} declared twice")
        self._items[name] = item_to_json(ValueItem(value), name)

    def write_shard(self, name: str, offsets: tuple[int, ...], data: np.ndarray) -> int:
        """Queue one shard of ``name`` at ``offsets``; returns its shard number.

        ``data`` is referenced, not copied, until its object is written: do not
        change it afterwards. May block while earlier batches are written.
        """
        it = self._items.get(name)
        if it is None or it["kind"] != "array":
            raise KeyError(f"{self.where}: {name!r} is not a declared array item")
        data = np.asarray(data)
        if data.dtype != it["_dtype"] or len(offsets) != len(it["shape"]) or data.ndim != len(it["shape"]):
            raise ValueError(
                f"{self.where}: item {name!r}: shard {data.dtype}{list(data.shape)} at {list(offsets)} "
                f"does not fit {it['_dtype']}{it['shape']}"
            )
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        n = len(it["shards"])
        it["shards"].append(shard_json([int(o) for o in offsets], list(data.shape), 0, []))
        view = memoryview(data.reshape(-1).view(np.uint8)) if data.nbytes else memoryview(b"")
        # A small shard is checksummed in small blocks of its own (a partial read rounds out little).
        block = extent_block(data.nbytes, list(data.shape) == it["shape"], self.store.engine.config.block_size)
        self._pending.append(Piece(name, n, view, block=block))
        self._keep.append(data)
        self._pending_bytes += data.nbytes
        if self._pending_bytes >= self.batch_bytes:
            self.flush()
        return n

    def flush(self) -> None:
        """Send the queued shards to the engine (returns once they are in flight)."""
        if not self._pending:
            return
        base = len(self.objects)
        plans = pack(
            self._pending,
            object_size=self.store.backend.layout_defaults.object_size,
            key_for=lambda n: self.store.naming.object_key(self.step_dir, self.save_id, 0, 1, base + n),
        )
        self.objects.extend(p.key for p in plans)
        nbytes = self._pending_bytes
        self._pending, self._keep, self._pending_bytes = [], [], 0
        while self._inflight and self._inflight_total + nbytes > self.inflight_bytes:
            self._reap_one()
        fut = submit(self.store.engine.write_objects(plans, self.progress))
        self._inflight.append((fut, plans, base, nbytes))
        self._inflight_total += nbytes

    def _reap_one(self) -> None:
        fut, plans, base, nbytes = self._inflight.popleft()
        written = fut.result()
        for i, (plan, w) in enumerate(zip(plans, written)):
            for e, crcs in zip(plan.extents, w.crcs):
                shard = self._items[e.item]["shards"][e.shard]
                shard["extents"].append([base + i, e.offset, e.shard_offset, e.length, crcs, *([e.block] if e.block else [])])
            self.bytes_written += w.size
        self._inflight_total -= nbytes

    def finish(self) -> None:
        """Write everything queued and make it durable (the ``written`` state); no commit."""
        self.flush()
        while self._inflight:
            self._reap_one()
        run_sync(self.store.io.sync())
        for it in self._items.values():
            for s in it.get("shards", ()):
                s["extents"].sort(key=lambda e: e[2])
        self.state = SaveState.WRITTEN

    # -- the manifest ----------------------------------------------------

    def items_json(self) -> dict[str, Any]:
        """Every item's manifest JSON (after :meth:`finish`: with its extents)."""
        return {n: {k: v for k, v in it.items() if k != "_dtype"} for n, it in self._items.items()}

    def extents_of(self, name: str, shard: int) -> list[list[Any]]:
        """``[object, offset, shard_offset, length, crcs(, block)]`` of a written shard (after :meth:`finish`;
        ``block`` where the shard's extents have checksum blocks of their own, format 6)."""
        return self._items[name]["shards"][shard]["extents"]

    def head(self, tree: Any, metadata: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "format": "ckptio",
            "version": 1,
            "step": self.step,
            "checkpoint_id": self.save_id,
            "created": time.time(),
            "block_size": self.store.engine.config.block_size,
            "num_hosts": 1,
            "tree": tree,
            "metadata": metadata or {},
        }

    def commit(self, tree: Any = None, metadata: dict[str, Any] | None = None) -> Manifest:
        """Finish, then commit the manifest (create-if-absent, last). Returns it.

        ``tree`` is the structure (:mod:`ckptio.state.tree`'s JSON form); by default a
        flat dict of every item by name.
        """
        try:
            if self.state is not SaveState.WRITTEN:
                self.finish()
            if tree is None:
                tree = {"dict": {n: {"leaf": n} for n in self._items}}
            record = {"ok": True, "objects": list(self.objects), "items": self.items_json()}
            manifest = merge_records([record], self.head(tree, metadata), self.where)
        except BaseException:
            self.abort()
            raise
        return self.commit_manifest(manifest)

    def commit_manifest(self, manifest: Manifest) -> Manifest:
        """Commit a manifest built by the caller from :meth:`extents_of` (e.g. DCP's form)."""
        try:
            if self.state is not SaveState.WRITTEN:
                self.finish()
            self._tx.commit(manifest)
        except BaseException:
            self.abort()
            raise
        self._tx.end(ok=True)
        self.state = SaveState.COMMITTED
        log.info(
            "%s: committed (%d objects, %d bytes, streamed)",
            self.where,
            len(self.objects),
            self.bytes_written,
        )
        return manifest

    def abort(self) -> None:
        """Stop: wait for writes in flight (their objects become orphans for the sweep), and end the
        save's intent as failed, so deleters and a retry of this step need not wait out its lease."""
        self._pending, self._keep, self._pending_bytes = [], [], 0
        while self._inflight:
            fut = self._inflight.popleft()[0]
            try:
                fut.result()
            except BaseException:  # the failure being handled is the caller's
                pass
        self._inflight_total = 0
        self.state = SaveState.FAILED
        self._tx.end(ok=False)
