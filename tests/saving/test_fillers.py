"""ckptio.saving.fillers: a save's staging copy on the caller plus helpers, each object released once its own
arrays are copied (never before), every array copied once, the first error raised after helpers stop."""

from __future__ import annotations

import concurrent.futures
import importlib
import threading
import time

import numpy as np
import pytest

import ckptio
from ckptio.saving import fillers
from ckptio.saving.fillers import HELPER_MIN_BYTES, MAX_FILLERS, fill_objects, fillers_for


def _setup(n_objects: int, per_object: int) -> tuple[list[list[tuple[str, int]]], dict[tuple[str, int], np.ndarray]]:
    objects = [[(f"a{i}", j) for j in range(per_object)] for i in range(n_objects)]
    arrays = {k: np.zeros(1024, np.uint8) for keys in objects for k in keys}
    return objects, arrays


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_each_object_is_released_only_after_all_its_arrays_are_copied(threads: int) -> None:
    objects, arrays = _setup(6, 5)
    objects[3].append(objects[2][-1])  # a shard split across two objects
    filled: set[int] = set()
    lock = threading.Lock()
    counts: dict[int, int] = {}
    seen_at_release: dict[int, set[int]] = {}

    def fill(out: np.ndarray) -> None:
        time.sleep(0.001)  # let the threads interleave
        out[:] = 7
        with lock:
            filled.add(id(out))
            counts[id(out)] = counts.get(id(out), 0) + 1

    ready = [concurrent.futures.Future() for _ in objects]
    for i, fut in enumerate(ready):
        fut.add_done_callback(lambda _f, i=i: seen_at_release.__setitem__(i, set(filled)))
    fill_objects(fill, objects, arrays, ready, threads)
    assert all(f.done() and f.exception() is None for f in ready)
    for i, keys in enumerate(objects):
        assert {id(arrays[k]) for k in keys} <= seen_at_release[i]  # all its bytes were there first
    assert sorted(counts.values()) == [1] * len(arrays)  # the shared array too: copied once
    assert all((a == 7).all() for a in arrays.values())


@pytest.mark.parametrize("threads", [1, 3])
def test_a_failed_copy_raises_after_the_helpers_stop_and_leaves_its_objects_unreleased(threads: int) -> None:
    objects, arrays = _setup(4, 3)
    bad = id(arrays[objects[1][1]])
    calls = 0
    lock = threading.Lock()

    def fill(out: np.ndarray) -> None:
        nonlocal calls
        with lock:
            calls += 1
        if id(out) == bad:
            raise MemoryError("no room")

    ready = [concurrent.futures.Future() for _ in objects]
    with pytest.raises(MemoryError, match="no room"):
        fill_objects(fill, objects, arrays, ready, threads)
    assert not ready[1].done()  # its bytes were never all copied
    before, states = calls, [f.done() for f in ready]
    time.sleep(0.05)
    assert calls == before  # nothing copies after the call returned
    assert [f.done() for f in ready] == states  # and nothing resolves any more


def test_a_future_already_done_is_left_as_it_is() -> None:
    objects, arrays = _setup(3, 2)
    ready = [concurrent.futures.Future() for _ in objects]
    err = RuntimeError("write failed")
    ready[2].set_exception(err)
    assert ready[1].cancel()
    fill_objects(lambda out: None, objects, arrays, ready, 2)
    assert ready[0].result() is None
    assert ready[1].cancelled() and ready[2].exception() is err


def test_an_object_with_nothing_to_copy_is_released() -> None:
    ready = [concurrent.futures.Future()]
    fill_objects(lambda out: None, [[]], {}, ready, 2)
    assert ready[0].done()


def test_helpers_only_for_large_states_and_never_past_the_callers_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fillers, "usable_cores", lambda: 16)
    assert fillers_for(0) == 1
    assert fillers_for(HELPER_MIN_BYTES - 1) == 1
    assert fillers_for(2 * HELPER_MIN_BYTES) == 2
    assert fillers_for(1 << 40) == MAX_FILLERS
    monkeypatch.setattr(fillers, "usable_cores", lambda: 1)  # a training thread pinned to one core
    assert fillers_for(1 << 40) == 1


def test_a_save_copied_by_helpers_restores_bit_exact_and_is_a_snapshot(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(fillers, "usable_cores", lambda: 4)
    monkeypatch.setattr(fillers, "HELPER_MIN_BYTES", 1 << 20)
    rng = np.random.default_rng(1)
    state = {f"w{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(12)}
    expect = {k: v.copy() for k, v in state.items()}
    started: list[str] = []
    real = fillers.fill_objects

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        started.append(str(a[-1]))
        return real(*a, **k)

    monkeypatch.setattr(importlib.import_module("ckptio.saving.job"), "fill_objects", spy)
    h = ckptio.save(str(tmp_path / "ck"), state, 1, backend_options={"object_size": 2 << 20})
    for v in state.values():  # mutated once save() returned: the checkpoint holds the staged bytes
        v[:] = -1
    h.result()
    assert started and int(started[0]) > 1  # helpers did copy
    out = ckptio.restore(str(tmp_path / "ck"), 1)
    for k, v in expect.items():
        np.testing.assert_array_equal(out[k], v)
