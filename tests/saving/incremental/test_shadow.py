"""Shadows (ckptio/incremental/shadow.py): an incremental manager finds unchanged private copies by a
byte compare with what its last committed save wrote -- no digest -- and never aliases different
bytes, whatever the caller does to its arrays between saves (in place, reverts, dtype views, items
dropped and back, a failed save)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio.engine import run_sync
from ckptio.manifest import ArrayItem, Manifest
from ckptio.manifest.names import step_of_key
from ckptio.saving.incremental import compare as compare_mod
from ckptio.saving.incremental import plan as plan_mod
from ckptio.saving.incremental.shadow import Shadows, same_bytes
from ckptio.saving.staging import StagingArea, stage_leaf
from ckptio.system.bufferpool import StagingPool

N = 96 << 10  # float32 elements: 384 KiB, above the packing threshold (staged as its own copy)


def item_steps(m: Manifest, name: str) -> set[str | None]:
    item = m.items[name]
    assert isinstance(item, ArrayItem)
    return {step_of_key(m.objects[e.object]) for s in item.shards for e in s.extents}


def test_same_bytes_compares_every_byte() -> None:
    a = np.random.default_rng(0).integers(0, 255, (3 << 20) + 5, dtype=np.uint8)
    b = a.copy()
    assert same_bytes(a, b)
    for i in (0, 1 << 20, len(a) - 1):
        b[i] ^= 1
        assert not same_bytes(a, b)
        b[i] ^= 1
    assert not same_bytes(a, b[:-1])
    assert same_bytes(a.view(np.uint8)[:4].view(np.float32), a[:4].view(np.int32))  # bytes, not dtypes


@pytest.mark.parametrize("parallel", [False, True])
def test_equal_pairs_compares_every_byte_of_every_pair(parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many pairs at once (chunks on several threads, or one): a pair is equal only when every byte
    is, whichever chunk holds the difference, and a difference in one pair leaves the others alone."""
    monkeypatch.setattr(compare_mod, "_CHUNK", 1 << 12)
    monkeypatch.setattr(compare_mod, "_PARALLEL_MIN", 0 if parallel else 1 << 40)
    monkeypatch.setattr(compare_mod, "_THREADS", 3 if parallel else 1)
    rng = np.random.default_rng(1)
    a = {i: rng.integers(0, 255, (i + 1) * 5000 + i, dtype=np.uint8) for i in range(8)}
    b = {i: x.copy() for i, x in a.items()}
    for i, at in ((1, 0), (3, 4096), (5, len(b[5]) - 1), (6, 7777)):
        b[i][at] ^= 0x80
    pairs = {i: (a[i], b[i]) for i in a}
    pairs[7] = (a[7], b[7][:-1])  # a shorter buffer is never equal
    pairs[8] = (a[0][:8].view(np.float32), a[0][:8].view(np.int32))  # bytes, not dtypes
    assert compare_mod.equal_pairs(pairs) == {0, 2, 4, 8}


def test_a_frozen_base_is_compared_not_digested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_digest(_data: Any) -> str:
        raise AssertionError("a private copy was digested")

    monkeypatch.setattr(plan_mod, "digest_of", no_digest)
    frozen = np.random.default_rng(0).standard_normal(4 * N).astype(np.float32)
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True)
    for step in range(1, 4):
        mngr.save(step, {"frozen": frozen, "moving": np.full(N, step, np.float32)}, force=True)
        mngr.wait_until_finished()
    m = run_sync(mngr.store.read_manifest("3"))
    assert item_steps(m, "frozen") == {"1"} and item_steps(m, "moving") == {"3"}
    assert m.digests is None
    assert np.asarray(mngr.restore(3)["frozen"]).tobytes() == frozen.tobytes()
    mngr.close()


def _mutate(rng: random.Random, name: str, cur: dict[str, np.ndarray], history: list[dict[str, np.ndarray]]) -> None:
    """One of the things a caller may do to an array between saves."""
    op = rng.choice(["keep", "copy", "in place", "revert", "dtype", "drop", "new"])
    a = cur.get(name)
    if a is None or op == "new":
        cur[name] = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(N).astype(np.float32)
    elif op == "copy":
        cur[name] = a.copy()  # equal bytes, another buffer
    elif op == "in place":
        a.reshape(-1).view(np.uint8)[rng.randrange(a.nbytes)] ^= 1 << rng.randrange(8)  # the shadow must not see it
    elif op == "revert":
        old = [h[name] for h in history[-3:] if name in h]
        cur[name] = old[0].copy() if old else a
    elif op == "dtype":
        cur[name] = a.view(np.int32 if a.dtype == np.float32 else np.float32)  # same bytes, another item
    elif op == "drop":
        del cur[name]


@pytest.mark.parametrize("seed", range(4))
def test_no_sequence_of_changes_aliases_different_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         seed: int) -> None:
    """After every save, every kept step restores exactly the state it saved; an item is written
    exactly when its bytes or dtype differ from the last committed save's (or that save failed)."""
    rng = random.Random(seed)
    mngr = ckptio.CheckpointManager(tmp_path, incremental=True, max_to_keep=3, on_save_error="warn")
    cur: dict[str, np.ndarray] = {}
    saved: dict[int, dict[str, bytes | str]] = {}
    history: list[dict[str, np.ndarray]] = []
    last: dict[str, tuple[bytes, str]] | None = None  # the last committed save's items
    real_commit = mngr.store.commit
    for step in range(1, 13):
        for name in ("a", "b", "c"):
            _mutate(rng, name, cur, history)
        fail = step > 2 and rng.random() < 0.15

        async def failing_commit(*_a: Any, **_k: Any) -> None:
            raise OSError("injected: the commit failed")

        monkeypatch.setattr(mngr.store, "commit", failing_commit if fail else real_commit)
        snapshot = {k: (v.tobytes(), str(v.dtype)) for k, v in cur.items()}
        mngr.save(step, {**cur, "step": step}, force=True)
        mngr.wait_until_finished()
        history.append({k: v.copy() for k, v in cur.items()})
        if fail:
            assert mngr.save_failures.count and step not in mngr.all_steps()
            last = None
            continue
        saved[step] = snapshot  # type: ignore[assignment]
        m = run_sync(mngr.store.read_manifest(str(step)))
        for name, value in snapshot.items():
            unchanged = last is not None and last.get(name) == value
            assert (str(step) not in item_steps(m, name)) == unchanged, (step, name)
        last = snapshot
        for kept in mngr.all_steps():
            out = mngr.restore(kept)
            want = saved[kept]
            assert {k for k in out if k != "step"} == set(want)
            for name, (data, dtype) in want.items():  # type: ignore[misc]
                assert np.asarray(out[name]).tobytes() == data and str(out[name].dtype) == dtype, (kept, name)
    mngr.close()


def test_a_shadow_is_a_private_copy_held_until_replaced() -> None:
    """settle() installs an offer only for the commit of the same save; its buffers leave the area
    (never given back to the pool while held), and a failed save's and replaced ones go back."""
    pool = StagingPool()
    area = StagingArea(pool)
    src = np.arange(N, dtype=np.float32)
    staged = {"w": stage_leaf("w", src, host=0, area=area)}
    area.fill_all()
    shadows = Shadows()
    key = ("w", ((0,), (N,)))
    shadows.offer("s1", [], [key], staged, area)
    assert area.owned == []  # taken out: release() cannot give it back
    m = type("M", (), {"checkpoint_id": "s1"})()
    shadows.settle(m)  # type: ignore[arg-type]
    assert len(shadows) == 1 and shadows.cid == "s1"
    assert shadows.unchanged(m, "w", key[1], src)  # type: ignore[arg-type]
    src[7] += 1  # the caller's array changes in place: the shadow is a copy
    assert not shadows.unchanged(m, "w", key[1], src)  # type: ignore[arg-type]
    other = type("M", (), {"checkpoint_id": "s2"})()
    assert not shadows.unchanged(other, "w", key[1], np.arange(N, dtype=np.float32))  # type: ignore[arg-type]
    assert not pool.has(N * 4)
    shadows.offer("s3", [], [], {}, StagingArea(pool))
    shadows.settle(other)  # type: ignore[arg-type]  # not the offer's commit: nothing can be proven
    assert len(shadows) == 0 and shadows.cid is None and pool.has(N * 4)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_compares_on_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's compare threads do not exist in a forked child: its compares must not wait on them."""
    import os

    monkeypatch.setattr(compare_mod, "_CHUNK", 1 << 12)
    monkeypatch.setattr(compare_mod, "_PARALLEL_MIN", 0)
    monkeypatch.setattr(compare_mod, "_THREADS", 2)
    a = np.arange(1 << 16, dtype=np.uint8)
    assert compare_mod.equal_pairs({0: (a, a.copy())}) == {0}  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if its compare completes (a hang fails the test by timeout)
        import signal

        signal.alarm(20)
        os._exit(0 if compare_mod.equal_pairs({0: (a, a.copy())}) == {0} else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
