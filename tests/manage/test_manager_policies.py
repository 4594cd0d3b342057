"""CheckpointManager policies (issue #38, items 3 and 4): a failed save that does not end the run
(``on_save_error="warn"``), and best-N retention by metrics that never evicts the newest step."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptio
from ckptio.backends import Backend, ObjectInfo, open_backend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.manage.best_n import METRICS_KEY
from ckptio.manifest import MANIFEST_NAME
from ckptio.manifest.names import parse_object


class Outage(WrapperBackend):
    """Storage that fails while ``down`` says so: ``"data"`` fails the writes of data objects only (a
    save starts, then fails in the background); ``"all"`` fails every write, listing, stat and delete;
    ``"delete"`` fails deletions only (retention)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.down: str | None = None

    def _fail(self, what: str, key: str) -> None:
        if self.down == what or self.down == "all":
            raise ConnectionError(f"{key!r}: storage unavailable")

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        if parse_object(key) is not None:
            self._fail("data", key)
        self._fail("write", key)
        await super().write(key, buffers)

    async def delete(self, key: str) -> None:
        self._fail("delete", key)
        await super().delete(key)

    async def stat(self, key: str) -> ObjectInfo:
        self._fail("stat", key)
        return await super().stat(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._fail("list", prefix)
        return await super().list(prefix)

    async def list_children(self, prefix: str = "") -> list[str]:
        self._fail("list", prefix)
        return await super().list_children(prefix)


def _state(step: int) -> dict[str, Any]:
    return {"w": np.full(8, step, np.float32), "step": step}


def _outage_manager(root: Path, **kw: Any) -> tuple[Outage, ckptio.CheckpointManager]:
    backend = Outage(open_backend(str(root)))
    return backend, ckptio.CheckpointManager(root, backend=backend, **kw)


def _on_disk(root: Path) -> list[int]:
    return sorted(int(d) for d in os.listdir(root) if d.isdigit() and (root / d / MANIFEST_NAME).exists())


# -- on_save_error ------------------------------------------------------------


def test_warn_a_failed_background_save_is_counted_and_the_next_one_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend, mngr = _outage_manager(tmp_path, on_save_error="warn", max_to_keep=2)
    with mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
        backend.down = "data"
        h = mngr.save(2, _state(2))
        assert h is not None  # it started: the failure comes in the background
        with caplog.at_level(logging.WARNING, logger="ckptio.manager"):
            mngr.wait_until_finished()  # logged and counted, not raised
        assert h.state == ckptio.SaveState.FAILED
        f = mngr.save_failures
        assert (f.count, f.since_last_good, f.last_good_step) == (1, [2], 1)
        assert isinstance(f.last_error, ConnectionError)
        assert any("step 2 failed" in r.getMessage() and r.exc_info for r in caplog.records)
        # Nothing broken is committed: step 2 is not listed, and nothing of it restores.
        assert mngr.all_steps() == [1]
        assert run_sync(mngr.store.status("2")).state != "committed"
        backend.down = None
        mngr.save(3, _state(3))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 3]
        assert (f.count, f.since_last_good, f.last_good_step) == (1, [], 3)
        assert mngr.restore()["step"] == 3 and (mngr.restore(1)["w"] == 1).all()


def test_warn_an_outage_before_the_save_starts_skips_the_step(tmp_path: Path) -> None:
    """Storage down at save(): even the listing that decides "should this step be saved" fails."""
    backend, mngr = _outage_manager(tmp_path, on_save_error="warn")
    with mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
        backend.down = "all"
        assert mngr.save(2, _state(2)) is None
        assert mngr.save(3, _state(3), force=True) is None  # an intent that cannot be written
        assert mngr.save_failures.since_last_good == [2, 3]
        backend.down = None
        assert mngr.save(4, _state(4)) is not None
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 4] and mngr.save_failures.count == 2
        assert mngr.save_failures.since_last_good == []


def test_warn_a_failed_retention_is_counted_and_its_checkpoint_stays(tmp_path: Path) -> None:
    backend, mngr = _outage_manager(tmp_path, on_save_error="warn", max_to_keep=1)
    with mngr:
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
        backend.down = "delete"
        mngr.save(2, _state(2))
        mngr.wait_until_finished()
        assert mngr.save_failures.retention == 1 and mngr.save_failures.count == 0
        backend.down = None
        mngr.save(3, _state(3))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [3] and mngr.restore()["step"] == 3


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_a_save_refused_for_bad_input_raises_at_once_in_both_modes(tmp_path: Path, mode: str) -> None:
    with ckptio.CheckpointManager(tmp_path, on_save_error=mode, best_fn=lambda m: m["loss"]) as mngr:
        with pytest.raises(ckptio.UnsupportedLeafError):
            mngr.save(1, {"bad": object()})
        with pytest.raises(TypeError, match=r"metrics\['loss'\]"):
            mngr.save(1, _state(1), metrics={"loss": np.ones(3)})
        with pytest.raises(ValueError, match=r"metrics\['loss'\].*finite"):
            mngr.save(1, _state(1), metrics={"loss": math.nan})
        with pytest.raises(KeyError, match="loss"):  # best_fn cannot score them: raised, not stored
            mngr.save(1, _state(1), metrics={"accuracy": 0.5})
        with pytest.raises(ValueError, match="reserved"):
            mngr.save(1, _state(1), metadata={METRICS_KEY: {}})
        mngr.save(1, _state(1))
        mngr.wait_until_finished()
        with pytest.raises(FileExistsError):  # a re-save of a committed step
            mngr.save(1, _state(1), force=True)
        assert mngr.save_failures.count == 0
        assert not [d for d in os.listdir(tmp_path) if d.isdigit() and d != "1"]


def test_raise_mode_is_unchanged(tmp_path: Path) -> None:
    backend, mngr = _outage_manager(tmp_path)
    mngr.save(1, _state(1))
    mngr.wait_until_finished()
    backend.down = "data"
    mngr.save(2, _state(2))
    with pytest.raises(ConnectionError, match="storage unavailable"):
        mngr.wait_until_finished()
    backend.down = None
    mngr.save(3, _state(3))  # the failure was raised once: the next save goes ahead
    mngr.wait_until_finished()
    backend.down = "data"
    h = mngr.save(4, _state(4))
    assert h is not None
    with pytest.raises(ConnectionError):
        h.result()
    backend.down = None
    with pytest.raises(ConnectionError, match="storage unavailable"):
        mngr.save(5, _state(5))  # step 4's failure, raised at the next save
    assert mngr.save_failures.count == 2 and mngr.all_steps() == [1, 3]
    mngr.save(5, _state(5))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 3, 5]
    backend.down = "all"
    with pytest.raises(ConnectionError):  # storage down before the save starts: raised too
        mngr.save(4, _state(4))
    backend.down = None
    mngr.close()
    assert mngr.save_failures.count == 3 and mngr.all_steps() == [1, 3, 5]


# -- best-N retention -----------------------------------------------------------


def _run(root: Path, metrics: Sequence[Mapping[str, Any] | None], **kw: Any) -> list[int]:
    """Saves steps 1, 2, ... with ``metrics`` (None: without); the steps left on disk."""
    with ckptio.CheckpointManager(root, **kw) as mngr:
        for step, m in enumerate(metrics, 1):
            mngr.save(step, _state(step), metrics=m)
    return _on_disk(root)


def test_best_min_keeps_the_lowest_and_the_newest(tmp_path: Path) -> None:
    losses = [5.0, 1.0, 4.0, 2.0, 6.0, 7.0]
    kept = _run(tmp_path, [{"loss": x} for x in losses], max_to_keep=2, best_fn=lambda m: m["loss"])
    assert kept == [2, 4, 6]  # the two lowest, and step 6 though it is the worst


def test_best_max_keeps_the_highest(tmp_path: Path) -> None:
    acc = [0.5, 0.9, 0.1, 0.8, 0.95, 0.2]
    kept = _run(tmp_path, [{"acc": np.float32(x), "note": "eval"} for x in acc], max_to_keep=2,
                best_fn=lambda m: m["acc"], best_mode="max")
    assert kept == [2, 5, 6]


def test_best_newest_counts_among_the_best(tmp_path: Path) -> None:
    kept = _run(tmp_path, [{"loss": x} for x in (3, 2, 1)], max_to_keep=2, best_fn=lambda m: m["loss"])
    assert kept == [2, 3]


@pytest.mark.parametrize("keep_without", [True, False])
def test_best_steps_without_metrics(tmp_path: Path, keep_without: bool) -> None:
    metrics = [None, {"loss": 3}, None, {"loss": 1}, {"loss": 2}, None, {"loss": 4}]
    kept = _run(tmp_path, metrics, max_to_keep=2, best_fn=lambda m: m["loss"],
                keep_checkpoints_without_metrics=keep_without)
    # Without metrics: kept regardless, or ranked after every scored step.
    assert kept == ([1, 3, 4, 5, 6, 7] if keep_without else [4, 5, 7])


def test_best_keep_period_steps_are_kept_and_not_ranked(tmp_path: Path) -> None:
    losses = [1, 9, 2, 9, 3, 9, 4, 9]
    kept = _run(tmp_path, [{"loss": x} for x in losses], max_to_keep=2, keep_period=4,
                best_fn=lambda m: m["loss"])
    assert kept == [1, 3, 4, 8]  # 1 and 3 the best of the rest; 4 and 8 periodic; 8 the newest


def test_best_ranks_old_steps_after_a_restart_from_root_manifests_only(tmp_path: Path) -> None:
    _run(tmp_path, [{"loss": x} for x in (3, 1, 2)])  # no retention in the first run
    backend, mngr = _outage_manager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"])
    read: list[str] = []
    inner_read_into = backend.read_into

    async def recording(key: str, rng: Any, buffers: Any) -> None:
        read.append(key)
        await inner_read_into(key, rng, buffers)

    backend.read_into = recording  # type: ignore[method-assign]
    with mngr:
        mngr.save(4, _state(4), metrics={"loss": 5})
    assert _on_disk(tmp_path) == [2, 3, 4]
    assert read and all(k.endswith(MANIFEST_NAME) or parse_object(k) is None for k in read), read
    assert run_sync(mngr.store.read_manifest("2")).metadata[METRICS_KEY] == {"loss": 1}


def test_best_never_counts_nor_deletes_a_damaged_step(tmp_path: Path) -> None:
    _run(tmp_path, [{"loss": x} for x in (1, 2, 3, 4)])
    data = bytearray((tmp_path / "1" / MANIFEST_NAME).read_bytes())
    data[len(data) // 2] ^= 1  # the best step's manifest no longer validates
    (tmp_path / "1" / MANIFEST_NAME).write_bytes(bytes(data))
    [obj] = [p for p in (tmp_path / "2").iterdir() if parse_object(f"2/{p.name}")]
    obj.unlink()  # the second best lost its data
    with ckptio.CheckpointManager(tmp_path, max_to_keep=1, best_fn=lambda m: m["loss"]) as mngr:
        mngr.save(5, _state(5), metrics={"loss": 9}).result()
        # 1 and 2 are damaged: left alone, not counted; 3 is the best whole step; 5 the newest.
        assert sorted(int(d) for d in os.listdir(tmp_path) if d.isdigit()) == [1, 2, 3, 5]
        assert mngr.restore(3)["step"] == 3


def _model(saved: Mapping[int, int | None], keep: int, period: int | None, mode: str, keep_without: bool) -> set[int]:
    """What must survive, computed from every step saved so far (a step that falls out of the best N
    never climbs back: later steps only push it further down)."""
    periodic = {s for s in saved if period and s % period == 0}
    rest = [s for s in saved if s not in periodic]
    scored = sorted((s for s in rest if saved[s] is not None),
                    key=lambda s: ((saved[s] if mode == "min" else -saved[s]), -s))  # type: ignore[operator]
    unscored = sorted((s for s in rest if saved[s] is None), reverse=True)
    best = scored[:keep] if keep_without else (scored + unscored)[:keep]
    return {max(saved)} | periodic | set(best) | (set(unscored) if keep_without else set())


@settings(max_examples=30, deadline=None)
@given(
    metrics=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=1, max_size=8),
    keep=st.integers(1, 3),
    period=st.sampled_from([None, 2, 3]),
    mode=st.sampled_from(["min", "max"]),
    keep_without=st.booleans(),
)
def test_best_n_after_every_save(
    metrics: list[int | None], keep: int, period: int | None, mode: str, keep_without: bool
) -> None:
    with tempfile.TemporaryDirectory() as d, ckptio.CheckpointManager(
        d, max_to_keep=keep, keep_period=period, best_fn=lambda m: m["loss"], best_mode=mode,  # type: ignore[arg-type]
        keep_checkpoints_without_metrics=keep_without,
    ) as mngr:
        saved: dict[int, int | None] = {}
        for step, value in enumerate(metrics, 1):
            mngr.save(step, _state(step), metrics=None if value is None else {"loss": value})
            mngr.wait_until_finished()
            saved[step] = value
            assert set(mngr.all_steps()) == _model(saved, keep, period, mode, keep_without), (step, saved)
        assert mngr.restore()["step"] == len(metrics)
