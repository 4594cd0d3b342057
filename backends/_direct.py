"""Direct IO requests: which bytes go to the device as they lie in memory, which through a bounce buffer.

O_DIRECT moves whole aligned blocks between the device and aligned memory. A view is
*in step* with the file when its address is congruent to its file offset modulo the
alignment: from its first aligned byte on, memory and file are aligned together, so
its whole blocks go to the device in place and only its partial blocks at either end
are copied through a bounce buffer (:mod:`ckptio.backends._bounce`). ckptio's staging
buffers are page-aligned at aligned offsets (wholly in place); a sync ``dcp.save``
hands over torch's tensors as they are, 64 bytes past a page, and
``ckptio.engine.layout.direct_offset`` lays them out in step. A view out of step is bounced
whole. :func:`bounced_bytes` counts what a write would copy, so a backend can choose
the page cache for objects that are mostly out of step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from ckptio.backends._bounce import BOUNCE, BOUNCE_BYTES
from ckptio.backends._posix import preadv_all, pwritev_all
from ckptio.system.bytes import address, byte_views, copy_bytes, flat_bytes

__all__ = ["REQUEST_BYTES", "bounced_bytes", "mostly_unaligned", "read_direct", "write_direct"]

#: The most bytes one O_DIRECT write request gathers from consecutive views (one bounce buffer's worth).
REQUEST_BYTES = BOUNCE_BYTES


def _in_step(v: memoryview, at: int, align: int) -> tuple[int, int]:
    """``(head, n)`` for ``v`` at file offset ``at``: its ``n`` bytes from ``head`` on are whole blocks that go
    to the device as they lie (``n`` is 0 for a view out of step with the file)."""
    if (address(v) - at) % align:
        return v.nbytes, 0
    head = min(v.nbytes, -at % align)
    return head, v.nbytes - head - (v.nbytes - head) % align


def _bounced_and_total(buffers: Sequence[memoryview], align: int) -> tuple[int, int]:
    pos = bounced = 0
    for v in byte_views(buffers):
        bounced += v.nbytes - _in_step(v, pos, align)[1]
        pos += v.nbytes
    return bounced, pos


def bounced_bytes(buffers: Sequence[memoryview], align: int) -> int:
    """How many bytes of ``buffers``, written back to back from offset 0, a direct write copies first.

    A view in step with the file is written in place but for its partial blocks at either end; any
    other view is bounced whole. (The object's final partial block, counted here, goes through the page
    cache instead: :func:`write_direct` copies exactly this count less ``total % align``.)
    """
    return _bounced_and_total(buffers, align)[0]


def mostly_unaligned(buffers: Sequence[memoryview], align: int) -> bool:
    """Whether most bytes of ``buffers`` would pass through a bounce buffer (:func:`bounced_bytes`)."""
    bounced, total = _bounced_and_total(buffers, align)
    return 2 * bounced >= total


def write_direct(dfd: int, fd: int, buffers: Sequence[memoryview], align: int,
                 gate: Callable[[int], None] | None = None) -> None:
    """``buffers`` back to back from offset 0: the aligned bulk through the O_DIRECT descriptor ``dfd``,
    the final partial block through ``fd`` (the same file, opened without O_DIRECT).

    Blocks in step with the file go to the device as they lie: no copy at all. Other bytes are
    gathered into a bounce buffer lent by the process's pool. A request gathers in-place views and
    bounced runs alike, up to :data:`REQUEST_BYTES` or a full bounce buffer: each O_DIRECT write
    waits for the device, so a small view written on its own (a DCP chunk's 4 KiB ``torch.save``
    frame beside its 8 MiB of data) cost a whole round trip behind the other streams' large writes.
    A bounced run starts and ends on aligned file offsets, so every request is whole blocks.

    ``gate(end)``, when given, is called before any byte below ``end`` is read (a write that starts
    while its buffers are still being filled, :meth:`ckptio.backends.base.Backend.write_filling`);
    requests then hold at most :data:`REQUEST_BYTES`, so that the first goes out as soon as its
    bytes are in.
    """
    views = byte_views(buffers)  # empty views dropped: cast() refuses views with a zero in their shape
    total = sum(v.nbytes for v in views)
    direct_end = total - total % align
    with contextlib.ExitStack() as lent:
        bounce: memoryview | None = None  # taken from the pool at the first bounced byte
        pos = 0  # bytes on the device so far
        request: list[memoryview] = []  # the next request's views, in place and bounced runs
        nrequest = 0
        seg = filled = 0  # the open bounced run: bounce[seg:filled], after the request's views
        tail: list[memoryview] = []

        def close_run() -> None:
            nonlocal nrequest, seg
            if filled > seg:
                request.append(bounce[seg:filled])  # type: ignore[index]
                nrequest, seg = nrequest + filled - seg, filled

        def send() -> None:
            nonlocal pos, request, nrequest, seg, filled
            close_run()
            if gate is not None:
                gate(pos + nrequest)
            pos += pwritev_all(dfd, request, pos)
            request, nrequest, seg, filled = [], 0, 0, 0

        for v in views:
            while v.nbytes and pos + nrequest + filled - seg < direct_end:
                at = pos + nrequest + filled - seg  # v's first byte in the file
                if at % align == 0 and address(v) % align == 0:
                    n = min(v.nbytes, direct_end - at)
                    if gate is not None:  # whole requests from whatever is in already
                        n = min(n, REQUEST_BYTES - nrequest)
                    n -= n % align
                    if n:
                        close_run()  # it ends here, on an aligned offset: whole blocks
                        request.append(v[:n])
                        nrequest, v = nrequest + n, v[n:]
                        if nrequest >= REQUEST_BYTES or at + n == direct_end:
                            send()
                        continue
                if bounce is None:
                    bounce = lent.enter_context(BOUNCE.lend())
                    bounce = bounce[: min(bounce.nbytes - bounce.nbytes % align, direct_end)]
                take = min(v.nbytes, len(bounce) - filled, direct_end - at)
                if (address(v) - at) % align == 0:  # in step: bounce only up to its next aligned byte
                    take = min(take, -address(v) % align or take)
                if gate is not None:
                    gate(at + take)
                copy_bytes(bounce[filled : filled + take], v[:take])
                filled, v = filled + take, v[take:]
                if filled == len(bounce) or at + take == direct_end:
                    send()
            if v.nbytes:
                tail.append(v)
    if tail:
        if gate is not None:
            gate(total)
        pwritev_all(fd, tail, direct_end)


def read_direct(dfd: int, fd: int, offset: int, buffers: Sequence[memoryview], align: int) -> None:
    """Fill ``buffers`` from ``offset`` on: each one's blocks in step with the file through the O_DIRECT
    descriptor ``dfd`` (no page-cache copy), the rest (memory out of step, partial blocks at either end)
    through ``fd``."""
    for b in buffers:
        v = flat_bytes(b)
        head, n = _in_step(v, offset, align)
        if not n:
            head = v.nbytes  # nothing in place: one read through the page cache
        if head:
            preadv_all(fd, [v[:head]], offset)
        if n:
            preadv_all(dfd, [v[head : head + n]], offset + head)
        if head + n < v.nbytes:
            preadv_all(fd, [v[head + n :]], offset + head + n)
        offset += v.nbytes
