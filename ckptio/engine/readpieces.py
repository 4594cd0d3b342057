"""A read request and its cutting into pieces that each verify on their own.

The engine reads a large merged request piece by piece, verifying each piece while
the next one is read (``Engine._read_verified``); :func:`split_request` cuts only
at checksum block boundaries of every check a cut falls into. Pure byte
arithmetic over caller-owned buffers: no IO, no copies except where a slice
straddles two buffers.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Sequence

from ckptio.backends.base import ByteRange
from ckptio.engine.scratch import ScratchSlice
from ckptio.system import flat_bytes
from ckptio.system.checksum import DEFAULT_BLOCK_SIZE

__all__ = ["ConcatView", "ReadRequest", "split_request"]


@dataclasses.dataclass(slots=True)
class ReadRequest:
    """Read ``rng`` of ``key`` into ``buffers``, verify ``checks``, then run ``after`` (in a thread).

    ``checks`` are ``(offset within the request, length, expected block crcs, item)``.
    ``buffers`` may name scratch (:class:`ckptio.engine.scratch.ScratchSlice`) that gets its
    memory only when the read starts.
    """

    key: str
    rng: ByteRange
    buffers: list[memoryview | ScratchSlice]
    checks: list[tuple[int, int, list[int], str]]
    after: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    #: The checkpoint's checksum block size (from its manifest, not this engine's config).
    block_size: int = DEFAULT_BLOCK_SIZE


def _slice_buffers(buffers: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """Views of the bytes ``[start, end)`` of the concatenation of ``buffers`` (no copy)."""
    out: list[memoryview] = []
    pos = 0
    for b in buffers:
        v = flat_bytes(b) if b.nbytes else b
        lo, hi = max(start, pos), min(end, pos + v.nbytes)
        if lo < hi:
            out.append(v[lo - pos : hi - pos])
        pos += v.nbytes
        if pos >= end:
            break
    return out


def split_request(req: ReadRequest, piece: int) -> list[ReadRequest]:
    """``req`` as consecutive pieces of about ``piece`` bytes, cut only at checksum block
    boundaries of every check a cut falls into (so each piece verifies on its own).

    The pieces share ``req``'s buffers (views, no copy) and carry no ``after`` callbacks:
    those run once the whole request is verified.
    """
    total = req.rng.length
    if total <= piece or not req.checks:
        return [ReadRequest(req.key, req.rng, req.buffers, req.checks, [], req.block_size)]
    bs = req.block_size
    checks = sorted(req.checks, key=lambda c: c[0])
    starts = [c[0] for c in checks]

    def inside(x: int) -> tuple[int, int] | None:
        """The (offset, end) of the check that ``x`` falls strictly inside, if any."""
        i = bisect.bisect_right(starts, x) - 1
        if i >= 0 and checks[i][0] < x < checks[i][0] + checks[i][1]:
            return checks[i][0], checks[i][0] + checks[i][1]
        return None

    cuts: list[int] = []
    pos = 0
    while total - pos > piece:
        cut = pos + piece
        box = inside(cut)
        if box is not None:  # back to a block boundary of that check (its start is one)
            cut = box[0] + (cut - box[0]) // bs * bs
            if cut <= pos:  # the piece lies inside one block run: forward to the next boundary
                cut = min(box[0] + ((pos - box[0]) // bs + 1) * bs, box[1])
        if cut >= total:
            break
        cuts.append(cut)
        pos = cut
    bounds = [0, *cuts, total]
    out: list[ReadRequest] = []
    for a, b in zip(bounds, bounds[1:]):
        if a >= b:
            continue
        mine = []
        # Checks do not overlap and are sorted: start from the one holding byte ``a``
        # (thousands of small checks in one merged read must not cost checks x pieces).
        for offset, length, crcs, item in itertools.islice(checks, max(0, bisect.bisect_right(starts, a) - 1), None):
            if offset >= b:
                break
            lo, hi = max(a, offset), min(b, offset + length)
            if lo == offset and hi == offset + length:  # the whole check: its checksums as they are
                mine.append((offset - a, length, crcs, item))
            elif lo < hi:
                k0, k1 = (lo - offset) // bs, -(-(hi - offset) // bs)
                mine.append((lo - a, hi - lo, crcs[k0:k1], item))
        rng = ByteRange(req.rng.start + a, req.rng.start + b)
        out.append(ReadRequest(req.key, rng, _slice_buffers(req.buffers, a, b), mine, [], bs))
    return out


class ConcatView:
    """Byte-offset slicing over a list of buffers (copies only when a slice straddles two)."""

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = [flat_bytes(b) for b in buffers]
        self.starts = []
        pos = 0
        for b in self.buffers:
            self.starts.append(pos)
            pos += b.nbytes

    def slice(self, offset: int, length: int) -> memoryview:
        i = bisect.bisect_right(self.starts, offset) - 1  # the buffer holding the first byte
        parts = []
        while i < len(self.buffers) and self.starts[i] < offset + length:
            start, b = self.starts[i], self.buffers[i]
            lo, hi = max(offset, start), min(offset + length, start + b.nbytes)
            if lo < hi:
                parts.append(b[lo - start : hi - start])
            i += 1
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))

