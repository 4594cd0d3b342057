"""Checkpoints stock torch can read: each tensor chunk framed as a ``torch.save`` record, and DCP's ``.metadata``.

Stock ``FileSystemReader`` (and ``format_utils.dcp_to_torch_save``, built on
it) unpickles ``<checkpoint>/.metadata``, whose ``storage_data`` maps each
chunk to a ``_StorageInfo(relative_path, offset, length)``, then
``torch.load``\\ s each tensor chunk's byte range: a whole ``torch.save`` zip.
It has no raw-bytes path for tensors. So on a POSIX path the Writer stores
every untransformed tensor chunk inside the zip frame ``torch.save`` itself
would write around it::

    [head: zip headers, data.pkl, byteorder, data/0's header][raw C-order bytes][tail: descriptor, version, ..., central directory]

The frame comes from torch's own writer: ``torch.save`` under
``torch.serialization.skip_data()`` writes every header and record but skips
over the storage's bytes (a relative seek), so :func:`frame` captures the
bytes before and after that gap without copying or reading any tensor data.
The data record's CRC-32 is then 0, exactly what ``torch.save`` writes under
``torch.utils.serialization.config.save.compute_crc32 = False`` (which
``torch.load`` reads): no checksum pass over the data is added. torch aligns
the data to 64 bytes within the record and a record starts 64-aligned in its
object, so the raw bytes stay aligned. (Under direct IO a large chunk's bytes
sit at the offset congruent to their address modulo the page, as aligned as
that memory: 64 for torch's own tensors, 16 for numpy's, always enough for the
dtype. Stock torch reads a record's byte range into memory of its own, and its
zip offsets are relative to the record's start.) ckptio's manifest points at the raw
bytes inside the record (its extents and checksums cover exactly them), so
ckptio's own readers never parse the frame.

A record is never split over objects (``_StorageInfo`` names one file), so
:func:`pack_records` packs whole records: a chunk larger than the object
size is an object of its own. Byte items are stored raw, as stock DCP does.

``.metadata`` is the only pickle in the directory: written *for* torch after
ckptio's manifest commits, never read by ckptio (the manifest records its
size and sha256 under ``metadata["dcp"]["companions"]``, which is how
deletion proves the file is ckptio's before removing it).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptio.engine.layout import DIRECT_MIN, ObjectPlan, PlannedExtent, direct_offset

__all__ = ["COMPANIONS", "DIRECT_MIN", "FRAME", "RECORD_ALIGN", "TORCH_METADATA", "Record", "companion_entry", "frame",
           "metadata_bytes", "pack_records"]

#: The file stock ``FileSystemReader`` reads first (DCP's ``_metadata_fn``).
TORCH_METADATA = ".metadata"
#: Where in a manifest's ``metadata["dcp"]`` the files written for other tools are listed.
COMPANIONS = "companions"
#: The item name of frame extents (never in the manifest: the Writer skips them).
FRAME = "frame"
#: A record starts at a multiple of this in its object (torch aligns data to 64 inside the record), but where
#: direct IO lays a large chunk out in step with its memory (see _record_start).
RECORD_ALIGN = 64
#: An object may run ``object_size // FRAME_SLACK`` bytes past ``object_size`` (frames, padding): see pack_records.
FRAME_SLACK = 64


class _Gap(io.RawIOBase):
    """A writable stream that keeps the bytes written before and after the one skipped range."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.head: list[bytes] = []
        self.tail: list[bytes] = []
        self.skipped = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        (self.tail if self.skipped else self.head).append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.pos + offset
        if target != self.pos:
            if self.skipped or target < self.pos:
                raise OSError("torch.save seeked other than over one tensor's data")
            self.skipped = target - self.pos
        self.pos = target
        return self.pos

    def tell(self) -> int:
        return self.pos


def frame(dtype: Any, shape: Sequence[int]) -> tuple[bytes, bytes]:
    """``(head, tail)``: ``head + <the C-order bytes of a shape/dtype tensor> + tail`` is what ``torch.save`` writes.

    ``len(head)`` is a multiple of 64 (an empty tensor: the whole record). Built by torch's own writer, without data,
    once per dtype and shape in a process (a frame differs from another of its kind only in the 40-byte
    ``serialization_id`` torch.save draws, which ``torch.load`` only logs).
    """
    return _frame(dtype, tuple(int(n) for n in shape))


@functools.lru_cache(maxsize=4096)
def _frame(dtype: Any, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    import torch

    t = torch.empty(tuple(shape), dtype=dtype)  # never touched: skip_data writes no storage bytes
    out = _Gap()
    with torch.serialization.skip_data():
        torch.save(t, out)
    nbytes = t.numel() * t.element_size()
    if out.skipped != nbytes and not (nbytes == 0 and out.skipped == 0):
        raise OSError(f"torch.save skipped {out.skipped} bytes for a {nbytes}-byte {dtype} tensor")
    head = b"".join(out.head)
    if nbytes and len(head) % RECORD_ALIGN:  # an empty tensor's record is all head
        raise OSError(f"torch.save put a tensor's data at offset {len(head)}, not {RECORD_ALIGN}-aligned")
    return head, b"".join(out.tail)


@dataclasses.dataclass
class Record:
    """One WriteItem's stored bytes: ``data`` (what the manifest points at) between an optional frame."""

    item: int
    data: memoryview
    head: bytes = b""
    tail: bytes = b""
    block: int = 0
    sums: list[int] | None = None  # see ckptio.engine.layout.Piece.sums

    @property
    def length(self) -> int:
        return len(self.head) + self.data.nbytes + len(self.tail)


def pack_records(records: Sequence[Record], object_size: int, key_for: Callable[[int], str], align: int = 1,
                 in_place: bool = True) -> tuple[list[ObjectPlan], dict[int, tuple[str, int, int]]]:
    """Whole records packed into objects of about ``object_size`` (at most 1/:data:`FRAME_SLACK` more; one larger
    record: an object of its own).

    Returns the plans and, per record, ``(object key, offset, length)``. Frame bytes between two data
    extents (a tail, padding, the next head) are one extent named :data:`FRAME`: a small chunk costs the
    writer one extent more, not two. With ``align > 1`` (direct IO) a chunk of at least ``align`` bytes
    and :data:`DIRECT_MIN` starts where direct IO takes its memory as it lies (aligned staged buffers: an
    aligned offset, and frames are aligned memory, so back-to-back chunks and the frames between them need
    no bounce copy; a tensor 64 bytes past a page: 64 bytes past an aligned offset, so only its partial
    pages are bounced), as :func:`ckptio.engine.layout.pack` lays out large pieces. ``in_place=False``: the writer
    process writes aligned copies of the chunks, so their data starts aligned.
    """
    plans: list[ObjectPlan] = []
    where: dict[int, tuple[str, int, int]] = {}
    # Frames and alignment padding may take an object a little past ``object_size``: else they alone would push a
    # chunk that fills an object to a whole out of it (8 x 8 MiB chunks became 7 + 1 in 64 MiB objects: 5 objects,
    # 5 fsyncs and uneven streams for 256 MiB, where DCP itself writes 4).
    limit = object_size + object_size // FRAME_SLACK
    current: list[PlannedExtent] = []
    spans: list[tuple[int, int, int]] = []
    frame_at, frame_bytes = 0, bytearray()
    size = 0

    def flush() -> None:
        nonlocal frame_bytes
        if frame_bytes:
            current.append(PlannedExtent(FRAME, 0, 0, frame_at, _aligned_copy(frame_bytes, align)))
            frame_bytes = bytearray()

    def add_frame(part: bytes) -> None:
        nonlocal frame_at, size
        if part:
            if not frame_bytes:
                frame_at = size
            frame_bytes.extend(part)
            size += len(part)

    def close() -> None:
        nonlocal current, spans, size
        flush()
        if current:
            key = key_for(len(plans))
            plans.append(ObjectPlan(key, current))
            where.update((i, (key, at, n)) for i, at, n in spans)
            current, spans, size = [], [], 0

    for r in records:
        if r.data.nbytes == 0 and not r.head:
            continue  # nothing stored (as ckptio.engine.layout.pack): the reader makes empty chunks itself
        start = _record_start(size, len(r.head), r.data, align, in_place)
        if size and start + r.length > limit:
            close()
            start = _record_start(size, len(r.head), r.data, align, in_place)
        pad = start - size
        if frame_bytes or (align > 1 and r.head):
            add_frame(bytes(pad))  # one contiguous (with align: aligned) frame extent up to the data
        else:
            size += pad  # a gap: ObjectPlan.buffers writes its zeros
        spans.append((r.item, size, r.length))
        add_frame(r.head)
        if r.data.nbytes:
            flush()
            current.append(PlannedExtent(str(r.item), 0, 0, size, r.data, block=r.block, sums=r.sums))
            size += r.data.nbytes
        add_frame(r.tail)
    close()
    return plans, where


def _record_start(size: int, head: int, data: memoryview, align: int, in_place: bool = True) -> int:
    """Where a record goes after ``size`` bytes: 64-aligned; a large chunk's record where direct IO writes its
    data from memory as it lies (:func:`ckptio.engine.layout.direct_offset`: a sync save's tensors are not staged),
    which starts the record as aligned as that memory (torch's own tensors: 64; numpy's: 16)."""
    # Under DIRECT_MIN, padding (up to a page, beside a ~1.5 KB frame) costs more bytes than a bounce copy time.
    if align > 1 and align % RECORD_ALIGN == 0 and data.nbytes >= max(align, DIRECT_MIN):
        return direct_offset(size + head, data if in_place else None, align) - head
    return -(-size // RECORD_ALIGN) * RECORD_ALIGN


def _aligned_copy(data: bytearray, align: int) -> memoryview:
    """``data`` in memory aligned to ``align`` (direct IO writes aligned memory as it is)."""
    if align <= 1:
        return memoryview(bytes(data))
    buf = np.empty(len(data) + align, np.uint8)
    at = -buf.ctypes.data % align
    out = buf[at : at + len(data)]
    out[:] = np.frombuffer(data, np.uint8)
    return memoryview(out)  # type: ignore[arg-type]  # keeps buf alive


def metadata_bytes(metadata: Any, records: dict[Any, tuple[str, int, int]], step_key: Callable[[str], str]) -> bytes:
    """DCP's ``.metadata`` for stock torch: ``metadata`` with a ``_StorageInfo`` per index, pickled as torch does.

    ``records``: ``MetadataIndex -> (object key, offset, length)``; ``step_key`` makes a key relative to the
    checkpoint's directory.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    stock = copy.copy(metadata)
    stock.storage_data = {index: _StorageInfo(step_key(key), offset, length) for index, (key, offset, length)
                          in records.items()}
    return pickle.dumps(stock)  # FileSystemWriter: pickle.dump(metadata, file); ckptio never loads it


def companion_entry(data: bytes) -> dict[str, Any]:
    """The manifest's record of ``.metadata``: what proves a file there is the one ckptio wrote."""
    return {"name": TORCH_METADATA, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
