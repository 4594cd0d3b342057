"""Issue 17: restores verify piece by piece while reading on; save threads yield the CPU.

Properties only (CI is a loaded 2-core machine): which bytes each piece covers, that
every block is still verified (corruption anywhere is caught), that pieces cut only at
block boundaries, and that the save's worker threads run at a lower priority.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptio
from ckptio.backends.base import ByteRange
from ckptio.backends.local import LocalBackend
from ckptio.engine import Engine, EngineConfig, ReadRequest, split_request
from ckptio.errors import IntegrityError
from ckptio.system import background_pool, lower_this_thread
from ckptio.system.checksum import block_crcs


def _request(sizes: list[int], gaps: list[int], bs: int, nbufs: int) -> tuple[ReadRequest, bytes]:
    """A request over checks of ``sizes`` separated by ``gaps`` (padding), in ``nbufs`` buffers."""
    rng = np.random.default_rng(len(sizes) * 131 + bs)
    checks, pos = [], 0
    parts = []
    for i, (n, g) in enumerate(zip(sizes, gaps)):
        pos += g
        parts.append(bytes(g))
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        parts.append(data)
        checks.append((pos, n, block_crcs(memoryview(data), bs), f"item{i}"))
        pos += n
    blob = b"".join(parts)
    cut = sorted(rng.integers(0, len(blob) + 1, max(0, nbufs - 1)).tolist())
    bounds = [0, *cut, len(blob)]
    buffers = [memoryview(bytearray(blob[a:b])) for a, b in zip(bounds, bounds[1:])]
    return ReadRequest("k", ByteRange(100, 100 + len(blob)), buffers, checks, block_size=bs), blob


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    gaps=st.lists(st.integers(0, 40), min_size=6, max_size=6),
    bs=st.sampled_from([1, 7, 16, 64]),
    piece=st.integers(1, 400),
    nbufs=st.integers(1, 5),
)
def test_split_covers_the_request_and_cuts_only_at_block_boundaries(
    sizes: list[int], gaps: list[int], bs: int, piece: int, nbufs: int
) -> None:
    req, blob = _request(sizes, gaps, bs, nbufs)
    pieces = split_request(req, piece)
    # Consecutive, covering exactly the request, each piece's buffers exactly its range.
    assert pieces[0].rng.start == req.rng.start and pieces[-1].rng.end == req.rng.end
    for a, b in zip(pieces, pieces[1:]):
        assert a.rng.end == b.rng.start
    assert b"".join(bytes(v) for p in pieces for v in p.buffers) == blob
    for p in pieces:
        assert sum(v.nbytes for v in p.buffers) == p.rng.length
        assert not p.after
        # Every check of a piece verifies on its own: its crcs are exactly its bytes' blocks.
        got = b"".join(bytes(v) for v in p.buffers)
        for offset, length, crcs, _item in p.checks:
            assert block_crcs(memoryview(got[offset : offset + length]), bs) == crcs
    # Every byte of every check is still checked by some piece.
    checked = sum(length for p in pieces for _o, length, _c, _i in p.checks)
    assert checked == sum(sizes)


def test_split_keeps_small_requests_whole_and_pieces_near_the_size() -> None:
    req, _ = _request([1 << 20], [0], 4096, 1)
    assert len(split_request(req, 2 << 20)) == 1
    pieces = split_request(req, 256 << 10)
    assert len(pieces) == 4 and all(p.rng.length == 256 << 10 for p in pieces)


class _Wrapped:
    """A backend proxy that counts reads (a restore issues one per piece)."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.reads: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def read_into(self, key: str, rng: ByteRange, buffers: list[memoryview]) -> None:
        self.reads.append(rng.length)
        await self.inner.read_into(key, rng, buffers)


def test_a_restore_reads_in_pieces_and_catches_corruption_in_any_piece(tmp_path: object) -> None:
    url = str(tmp_path)
    bs = 4096
    cfg = EngineConfig(block_size=bs, read_piece_size=64 << 10)
    arr = np.arange(1 << 17, dtype=np.float32)  # 512 KiB: 8 pieces
    ckptio.save(url, {"a": arr}, step=1, engine_config=cfg).result()
    back = ckptio.restore(url, step=1, engine_config=cfg)
    np.testing.assert_array_equal(back["a"], arr)
    # Corrupt one byte near the end of the object (the last piece): still refused.
    objs = [os.path.join(d, f) for d, _, fs in os.walk(url) for f in fs if "manifest" not in f and "intent" not in f
            and os.path.getsize(os.path.join(d, f)) >= arr.nbytes]
    assert objs, "the array's object"
    with open(objs[0], "r+b") as f:
        f.seek(arr.nbytes - 10)
        b = f.read(1)
        f.seek(arr.nbytes - 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        ckptio.restore(url, step=1, engine_config=cfg)


def test_engine_issues_one_read_per_piece(tmp_path: object) -> None:
    backend = _Wrapped(LocalBackend(str(tmp_path)))
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    engine = Engine(backend, EngineConfig(block_size=4096, read_piece_size=256 << 10))  # type: ignore[arg-type]

    async def go() -> np.ndarray:
        await backend.inner.write("obj", [memoryview(data)])
        out = np.empty_like(data)
        req = ReadRequest("obj", ByteRange(0, data.nbytes), [memoryview(out)],
                          [(0, data.nbytes, block_crcs(memoryview(data), 4096), "x")], block_size=4096)
        done: list[bool] = []
        req.after.append(lambda: done.append(bool((out == data).all())))
        await engine.read([req])
        assert done == [True]  # after-callbacks run once, on the whole verified range
        return out

    try:
        out = asyncio.run(go())
    finally:
        engine.close()
    assert (out == data).all()
    assert backend.reads == [256 << 10] * 4


def test_reads_with_copy_out_merge_only_up_to_one_piece() -> None:
    """Adjacent reads through scratch (a tiled shard's tiles) stop merging at one piece, so their
    copy-outs run as each piece-sized read is verified instead of all at the end of one 64 MiB
    read; adjacent plain reads still merge up to ``max_read_size``."""
    engine = Engine(LocalBackend("/nonexistent-ckptio-test"), EngineConfig(read_piece_size=4 << 20))
    mib = 1 << 20

    def tiles(copy_out: bool) -> list[ReadRequest]:
        return [ReadRequest("obj", ByteRange(i * mib, (i + 1) * mib), [memoryview(bytearray(mib))], [],
                            [lambda: None] if copy_out else []) for i in range(32)]

    try:
        scattered = engine.coalesce(tiles(True))
        plain = engine.coalesce(tiles(False))
    finally:
        engine.close()
    assert [r.rng.length for r in scattered] == [4 * mib] * 8
    assert sum(len(r.after) for r in scattered) == 32  # every copy-out still runs, once
    assert [r.rng.length for r in plain] == [32 * mib]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_background_pool_threads_run_at_a_lower_priority() -> None:
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = background_pool(1, "t", 5)
    try:
        tid, nice = pool.submit(lambda: (threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0))).result()
        seen = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    finally:
        pool.shutdown()
    assert seen == min(19, mine + 5)
    # The caller's own thread is untouched.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    lower_this_thread(0)  # no-op
    assert tid != threading.get_native_id() and isinstance(nice, int)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_local_writes_run_on_lowered_threads_and_reuse_bounce_buffers_across_backends(tmp_path: object) -> None:
    """Writes run on lowered threads; their bounce buffers come from one process-wide pool, so a
    backend opened per save (the Orbax handler, ckptio.dcp.Writer) faults no fresh buffer in."""
    from ckptio.backends._bounce import BOUNCE

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    # Unaligned source memory (offset 64 into an array) goes through the bounce buffer.
    src = np.random.default_rng(1).integers(0, 256, (2 << 20) + 64, dtype=np.uint8)[64:]

    async def go(backend: LocalBackend, n: int) -> None:
        real = backend._write_direct

        def spy(tmp: str, fd: int, bufs: list[memoryview], filling: Any) -> None:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            real(tmp, fd, bufs, filling)

        backend._write_direct = spy  # type: ignore[method-assign]
        for i in range(3):
            await backend.write(f"b{n}/o{i}", [memoryview(src)])
        out = bytearray(src.nbytes)
        await backend.read_into(f"b{n}/o2", ByteRange(0, src.nbytes), [memoryview(out)])
        assert bytes(out) == src.tobytes()
        await backend.close()

    asyncio.run(go(LocalBackend(str(tmp_path), write_nice=3), 0))
    if not seen:
        pytest.skip("this file system refuses O_DIRECT")
    made, lent = BOUNCE.allocated, BOUNCE.lent
    asyncio.run(go(LocalBackend(str(tmp_path), write_nice=3), 1))  # a new backend, new threads
    assert all(n == min(19, mine + 3) for n in seen)
    assert BOUNCE.lent == lent + 3 and BOUNCE.allocated == made  # three writes, no new buffer
    assert 0 < BOUNCE.free_bytes() <= BOUNCE.keep * BOUNCE.size


@pytest.mark.parametrize("copy_out", [False, True], ids=["destination", "scratch"])
def test_large_pieces_are_faulted_in_before_they_are_read_and_corruption_in_any_is_caught(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, copy_out: bool
) -> None:
    """Pieces of 1 MiB or more of a final destination are populated before they are read (scratch
    with copy-out is not: it faults in as it is read), and every piece is still verified."""
    from ckptio.engine import core as engine_mod
    from ckptio.system import fresh_pages, populate

    events: list[tuple[str, int]] = []

    def spy(buffers: list[memoryview]) -> None:
        events.append(("populate", np.frombuffer(buffers[0], np.uint8).ctypes.data))
        populate(buffers)

    monkeypatch.setattr(engine_mod, "populate", spy)

    class _Recording(_Wrapped):
        async def read_into(self, key: str, rng: ByteRange, buffers: list[memoryview]) -> None:
            events.append(("read", np.frombuffer(buffers[0], np.uint8).ctypes.data))
            await self.inner.read_into(key, rng, buffers)

    backend = _Recording(LocalBackend(str(tmp_path)))
    bs, size = 64 << 10, 4 << 20
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    engine = Engine(backend, EngineConfig(block_size=bs, read_piece_size=1 << 20))  # type: ignore[arg-type]

    copied: list[bool] = []

    def request(out: np.ndarray) -> ReadRequest:
        after = [lambda: copied.append(bool((out == data).all()))] if copy_out else []
        return ReadRequest("obj", ByteRange(0, size), [memoryview(out)],
                           [(0, size, block_crcs(memoryview(data), bs), "x")], after, block_size=bs)

    async def go() -> np.ndarray:
        await backend.inner.write("obj", [memoryview(data)])
        out = fresh_pages(size)
        await engine.read([request(out)])
        return out

    try:
        out = asyncio.run(go())
        assert (out == data).all()
        assert copied == ([True] if copy_out else [])
        reads = [a for what, a in events if what == "read"]
        assert len(reads) == 4
        if copy_out:
            assert not [e for e in events if e[0] == "populate"]
        for a in reads if not copy_out else []:  # populated first: its populate comes earlier
            assert events.index(("populate", a)) < events.index(("read", a))
        path = os.path.join(str(tmp_path), "obj")
        with open(path, "r+b") as f:  # one flipped byte in the third piece
            f.seek(2 * (1 << 20) + 12345)
            b = f.read(1)
            f.seek(2 * (1 << 20) + 12345)
            f.write(bytes([b[0] ^ 0x01]))
        with pytest.raises(IntegrityError):
            asyncio.run(engine.read([request(fresh_pages(size))]))
    finally:
        engine.close()
