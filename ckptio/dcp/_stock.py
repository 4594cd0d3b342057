"""Stock DCP checkpoints (torch's ``FileSystemWriter`` layout) read through ckptio's backends and engine.

A stock checkpoint is a ``.metadata`` file -- DCP's ``Metadata`` *pickled*
by torch -- beside ``__<rank>_<n>.distcp`` files in which every tensor chunk
is a whole ``torch.save`` record at ``(offset, length)`` and every byte item
the planner's raw bytes, each possibly through stream transforms
(``_StorageInfo.transform_descriptors``, e.g. ``stream.zstd/1``). Ranks saved
without collectives write ``__<rank>.metadata`` instead.

Trust: reading ``.metadata`` unpickles it, as torch's ``FileSystemReader``
does -- that is stock DCP's format, and loading a stock checkpoint runs
whatever its pickle says. ckptio does not unpickle it itself: the bytes go
to ``FileSystemReader.read_metadata`` (torch's own loader, over an in-memory
file). Tensor records are loaded with ``torch.load(weights_only=True)``,
again as torch does. ``Reader(url, allow_stock=False)`` refuses stock
checkpoints altogether. ckptio's own format has no pickle.

Ranged reads: a large record of an untransformed tensor is first *probed*
-- its first and last few KiB, which hold the zip directory and the record's
small pickle; ``torch.load(map_location="meta")`` on those bytes alone says
where the tensor's storage starts in the record and its strides. A C-order
chunk is then read like a ckptio shard: only the rows the new sharding
needs, by byte range, concurrently. Everything else (small records,
transformed or strided ones, a probe that needs more bytes) is read whole
and loaded as torch's reader does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckptio.backends.base import ByteRange
from ckptio.engine import ReadRequest
from ckptio.manifest import ArrayItem, Extent, ShardRecord

__all__ = ["PROBE_BYTES", "RANGED_MIN_BYTES", "RecordLayout", "load_metadata", "metadata_key", "parse_probe",
           "probe_requests", "record_item"]

#: Bytes read from each end of a record to find its tensor's place.
PROBE_BYTES = 16 << 10
#: Records smaller than this are read whole (a probe would cost a round trip for little gain).
RANGED_MIN_BYTES = 1 << 20

_METADATA = ".metadata"


def metadata_key(step_dir: str, rank: int | None) -> str:
    """The key of a stock checkpoint's metadata: global, or rank ``rank``'s (saved without collectives)."""
    name = _METADATA if rank is None else f"__{rank}{_METADATA}"
    return f"{step_dir}/{name}" if step_dir else name


class _OneFile:
    """The part of torch's ``FileSystem`` that ``FileSystemReader.read_metadata`` uses, serving bytes we read."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def concat_path(self, path: Any, suffix: str) -> str:
        return f"{path}/{suffix}"

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.BytesIO]:
        yield io.BytesIO(self.data)


def load_metadata(data: bytes, rank: int | None) -> Any:
    """DCP ``Metadata`` from a stock ``.metadata`` file's bytes, unpickled by torch's ``FileSystemReader``."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader("ckptio-stock-metadata")  # a name only: every byte comes from ``_OneFile``
    reader.fs = _OneFile(data)  # type: ignore[assignment]
    return reader.read_metadata(rank=rank) if rank is not None else reader.read_metadata()


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Where a C-order tensor's bytes lie in its file: ``start`` (absolute) and its shape."""

    start: int
    shape: tuple[int, ...]


class _Miss(Exception):
    """The probe's bytes did not hold what torch's loader asked for."""


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only the probed head and tail are known."""

    def __init__(self, size: int, head: bytes, tail: bytes) -> None:
        super().__init__()
        self.size, self.head, self.tail, self.pos = size, head, tail, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.size - self.pos))
        a, b = self.pos, self.pos + n
        tail0 = self.size - len(self.tail)
        if b <= len(self.head):
            buf[:n] = self.head[a:b]
        elif a >= tail0:
            buf[:n] = self.tail[a - tail0 : b - tail0]
        else:
            raise _Miss(f"bytes [{a}, {b}) of the record were not probed")
        self.pos = b
        return n


def probe_requests(key: str, offset: int, length: int) -> tuple[list[ReadRequest], np.ndarray, np.ndarray]:
    """Requests for a record's head and tail (no checksums: stock files have none), and their buffers."""
    n = min(PROBE_BYTES, length)
    head, tail = np.empty(n, np.uint8), np.empty(n, np.uint8)
    reqs = [
        ReadRequest(key, ByteRange(offset, offset + n), [memoryview(head)], []),
        ReadRequest(key, ByteRange(offset + length - n, offset + length), [memoryview(tail)], []),
    ]
    return reqs, head, tail


def parse_probe(
    head: np.ndarray, tail: np.ndarray, offset: int, length: int, dtype: Any, sizes: tuple[int, ...]
) -> RecordLayout | None:
    """Where a ``torch.save`` record of a ``sizes`` tensor of ``dtype`` keeps its bytes, if they are C-order.

    None when the ends do not tell (a larger pickle or zip directory, another
    byte order, strides, another dtype or shape): the caller reads it whole.
    """
    import torch

    sparse = _Sparse(length, head.tobytes(), tail.tobytes())
    try:
        with zipfile.ZipFile(sparse) as z:  # a foreign byte order would need swapping: read whole instead
            order = [n for n in z.namelist() if n.endswith("/byteorder")]
            if order and z.read(order[0]).decode() != sys.byteorder:
                return None
        sparse.seek(0)
        meta = torch.load(sparse, map_location="meta", weights_only=True)
    except (_Miss, zipfile.BadZipFile, RuntimeError, ValueError, OSError, KeyError, EOFError):
        return None
    if not isinstance(meta, torch.Tensor) or meta.dtype != dtype or tuple(meta.shape) != sizes:
        return None
    if not meta.is_contiguous() or meta.layout != torch.strided:
        return None
    storage = meta.untyped_storage()
    at = getattr(storage, "_checkpoint_offset", None)
    nbytes = meta.numel() * meta.element_size()
    begin = (at or 0) + meta.storage_offset() * meta.element_size()
    if at is None or begin + nbytes > length or meta.storage_offset() * meta.element_size() + nbytes > storage.nbytes():
        return None
    return RecordLayout(offset + begin, sizes)


def record_item(layout: RecordLayout, dtype: np.dtype) -> ArrayItem:
    """A one-shard, one-extent array item over a probed record (object 0), without checksums."""
    nbytes = int(np.prod(layout.shape, dtype=np.int64)) * dtype.itemsize
    extent = Extent(0, layout.start, 0, nbytes, [], 1)  # no checksums: ranges read exactly
    return ArrayItem(dtype, layout.shape, [ShardRecord((0,) * len(layout.shape), layout.shape, 0, [extent])])
