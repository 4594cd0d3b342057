"""``Backend.read_many``: many small reads in one call, each as ``read_into`` would make it.

The store reads a restore's fragments (thousands of a few KiB to a few hundred) a batch to a
call; a wrapper that changes ``read_into`` (faults, counts, a budget) must still meet each read,
and a fragment missing or shorter than the root says is still named.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from tests.manifest.test_fragments import CountingReads

from ckptio.backends.base import ByteRange, Read
from ckptio.backends.deadline import DeadlineBackend, Deadlines
from ckptio.backends.local import LocalBackend
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.retrying import RetryingBackend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import IntegrityError
from ckptio.store import CheckpointStore
from ckptio.store.manifests import READS_PER_CALL

N = 2 * READS_PER_CALL + 5  # two whole calls and a part one


def _objects(root: Path, n: int = N) -> dict[str, bytes]:
    objs = {f"1/o{i}": os.urandom(2 + (i * 37) % 300) for i in range(n)}
    for key, data in objs.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return objs


def _reads(objs: dict[str, bytes]) -> tuple[list[Read], list[bytearray]]:
    bufs = [bytearray(len(d) - 1) for d in objs.values()]
    return [(k, ByteRange(1, len(d)), [memoryview(b)]) for (k, d), b in zip(objs.items(), bufs)], bufs


class CountingLocal(LocalBackend):
    """The local backend, counting its batched calls (its own ``read_into`` is untouched)."""

    calls = 0

    async def read_many(self, reads: Any) -> None:
        type(self).calls += 1
        await super().read_many(reads)


def test_local_read_many_fills_each_buffer_as_read_into_would(tmp_path: Path) -> None:
    objs = _objects(tmp_path)
    reads, bufs = _reads(objs)
    run_sync(LocalBackend(str(tmp_path)).read_many(reads))
    assert [bytes(b) for b in bufs] == [d[1:] for d in objs.values()]


@pytest.mark.parametrize("fault, error", [("missing", FileNotFoundError), ("short", ValueError)])
def test_local_read_many_fails_as_read_into_does(tmp_path: Path, fault: str, error: type) -> None:
    objs = _objects(tmp_path)
    reads, _ = _reads(objs)
    victim = tmp_path / reads[7][0]
    if fault == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(error):
        run_sync(LocalBackend(str(tmp_path)).read_many(reads))


def test_a_wrapper_that_changes_read_into_meets_every_read_of_a_batch(tmp_path: Path) -> None:
    objs = _objects(tmp_path)
    reads, bufs = _reads(objs)
    seen = CountingReads(LocalBackend(str(tmp_path)))
    run_sync(RetryingBackend(DeadlineBackend(seen, Deadlines())).read_many(reads))
    assert seen.keys == list(objs) and [bytes(b) for b in bufs] == [d[1:] for d in objs.values()]


def test_wrappers_that_leave_read_into_alone_pass_a_batch_on_as_one_call(tmp_path: Path) -> None:
    objs = _objects(tmp_path)
    reads, bufs = _reads(objs)
    CountingLocal.calls = 0
    run_sync(RetryingBackend(DeadlineBackend(WrapperBackend(CountingLocal(str(tmp_path))), Deadlines()))
             .read_many(reads))
    assert CountingLocal.calls == 1 and [bytes(b) for b in bufs] == [d[1:] for d in objs.values()]


def test_an_instance_given_its_own_read_into_meets_every_read(tmp_path: Path) -> None:
    objs = _objects(tmp_path)
    reads, bufs = _reads(objs)
    backend = LocalBackend(str(tmp_path))
    seen = CountingReads(LocalBackend(str(tmp_path)))
    backend.read_into = seen.read_into  # type: ignore[method-assign]
    run_sync(RetryingBackend(backend).read_many(reads))
    assert seen.keys == list(objs) and [bytes(b) for b in bufs] == [d[1:] for d in objs.values()]


def test_the_store_reads_fragments_a_batch_to_a_call(tmp_path: Path) -> None:
    objs = _objects(tmp_path)
    CountingLocal.calls = 0
    store = CheckpointStore(str(tmp_path), backend=CountingLocal(str(tmp_path)))
    ranges = [(k, 1, len(d)) for k, d in objs.items()]
    got = run_sync(store.manifests._read_ranges(ranges, "here"))
    assert got == [d[1:] for d in objs.values()]
    assert CountingLocal.calls == -(-N // READS_PER_CALL)


@pytest.mark.parametrize("fault, words", [("missing", "is missing"), ("short", "shorter than the root")])
def test_a_fragment_missing_or_short_in_a_batch_is_named(tmp_path: Path, fault: str, words: str) -> None:
    objs = _objects(tmp_path)
    victim = list(objs)[READS_PER_CALL + 3]  # inside the second call
    if fault == "missing":
        (tmp_path / victim).unlink()
    else:
        (tmp_path / victim).write_bytes(objs[victim][:-1])
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(IntegrityError, match=words) as e:
        run_sync(store.manifests._read_ranges([(k, 0, len(d)) for k, d in objs.items()], "here"))
    assert victim in str(e.value)


def test_only_a_backend_that_batches_reads_is_asked_to(tmp_path: Path) -> None:
    """Elsewhere each fragment read keeps its own retry and deadline, as many in flight as before."""
    local = LocalBackend(str(tmp_path))
    assert RetryingBackend(DeadlineBackend(WrapperBackend(local), Deadlines())).batches_reads
    assert not RetryingBackend(CountingReads(local)).batches_reads
    assert not RetryingBackend(DeadlineBackend(MemoryBackend(), Deadlines())).batches_reads
