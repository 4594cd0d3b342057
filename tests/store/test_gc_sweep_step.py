"""CheckpointStore.sweep_step: the orphan sweep's rules for one step, and nothing beyond that step.

The properties of tests/scenarios/test_never_lose.py, held by the one-step sweep that the tiers run when a
durable step completes: a dead attempt's objects and intents go; a live save's objects, foreign files,
a damaged step and every other step stay; it deletes exactly what the whole-root sweep would delete
in that step.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pytest
from tests.scenarios.test_never_lose import _RefuseCommit, files, same, save, state

import ckptio
from ckptio.backends import Capabilities, open_backend
from ckptio.backends.local import TMP_MARK
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME
from ckptio.manifest.names import parse_intent, parse_object
from ckptio.store import CheckpointStore, SweepReport
from ckptio.store.intents import new_id

#: Not ckptio's, though some look like it: none may ever be deleted.
FOREIGN = ["2/notes.txt", "2/ckptio.intent.xyz", "2/0123456789ab.h00000-00000.bak",
           "2/sub/0123456789ab.h00000-00000", "2/ckptio.replica-of.hxyz", "2/ckptio.replica-of.h00001.bak"]


def dead_attempt(url: str, step: int, **kw: Any) -> None:
    """A save of ``step`` that died before its commit: objects and an intent marked dead (zero lease)."""
    with pytest.raises(ConnectionAbortedError):
        ckptio.save(url, state(step), step=step, backend=_RefuseCommit(open_backend(url)), **kw).result()


def live_save(store: CheckpointStore, step_dir: str) -> str:
    """A save in flight in ``step_dir``: a fresh intent (an hour's lease) and one of its objects."""
    sid = new_id()
    run_sync(store.announce(step_dir, sid, 0, 3600.0))
    run_sync(store.backend.write(f"{step_dir}/{sid}.h00000-00000", [memoryview(b"in flight")]))
    return sid


def plant(root: Path, names: list[str]) -> None:
    """Foreign files, an hour old (old enough for any grace)."""
    old = time.time() - 3600
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("not ckptio's")
        os.utime(root / name, (old, old))


def in_step(keys: list[str], step: int) -> list[str]:
    """The keys that ckptio's names place in ``step``."""
    return sorted(k for k in keys
                  if (n := parse_object(k) or parse_intent(k)) is not None and n.step_dir == str(step))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1-3 committed, each beside a dead attempt; step 4 a dead attempt only; in step 2 a live save
    and foreign files."""
    url = str(tmp_path)
    for s in (1, 2, 3, 4):
        dead_attempt(url, s)
    for s in (1, 2, 3):
        save(url, s)
    plant(tmp_path, FOREIGN)
    return tmp_path


def test_sweep_step_deletes_its_steps_dead_attempts_and_nothing_else(root: Path) -> None:
    store = CheckpointStore(root)
    live = live_save(store, "2")
    whole = run_sync(store.sweep(0, dry_run=True))
    dry = run_sync(store.sweep_step(2, 0, dry_run=True))
    before = files(root)
    # The same rules as the whole-root sweep: exactly what it would delete in step 2.
    assert dry.objects == in_step(whole.objects, 2) and dry.objects
    assert sorted(dry.intents) == in_step(whole.intents, 2) and dry.intents
    assert files(root) == before  # a dry run deletes nothing

    report = run_sync(store.sweep_step(2, 0))
    assert isinstance(report, SweepReport)
    assert (report.objects, report.intents) == (dry.objects, dry.intents)
    after = files(root)
    assert before - after == set(report.deleted)
    assert report.spared_in_flight == 1 and f"2/{live}.h00000-00000" in after  # the live save's object
    assert f"2/ckptio.intent.{live}" in after
    assert all(name in after for name in FOREIGN)
    assert {f for f in before if not f.startswith("2/")} <= after  # other steps untouched
    for s in (1, 2, 3):
        assert same(ckptio.restore(root, step=s), s)
    # What is left to the whole-root sweep lies in the other steps.
    rest = run_sync(store.sweep(0, dry_run=True))
    assert in_step(rest.deleted, 2) == [] and in_step(rest.objects, 4)


def test_sweep_step_of_an_uncommitted_step_takes_the_dead_attempt_whole(root: Path) -> None:
    store = CheckpointStore(root)
    report = run_sync(store.sweep_step(4, 0))
    assert report.objects and report.intents
    assert in_step([i.key for i in run_sync(store.backend.list("4/"))], 4) == []
    assert run_sync(store.committed_steps()) == [1, 2, 3]


def test_sweep_step_spares_what_is_younger_than_the_grace(root: Path) -> None:
    store = CheckpointStore(root)
    before = files(root)
    report = run_sync(store.sweep_step(2, 3600))
    assert report.deleted == [] and files(root) == before


def test_sweep_step_reaches_its_step_under_every_hashed_prefix(tmp_path: Path) -> None:
    url, naming = str(tmp_path), HashedNaming()
    for s in (5, 6):
        dead_attempt(url, s, naming=naming)
    ckptio.save(url, state(5), step=5, naming=naming).result()
    store = CheckpointStore(url)
    keys = [i.key for i in run_sync(store.backend.list(""))]
    kept = set(run_sync(store.read_manifest("5")).keys())
    dead5 = [k for k in in_step(keys, 5) if k not in kept]
    assert any(k.startswith("h") for k in dead5)  # the dead attempt's objects lie under hashed prefixes
    report = run_sync(store.sweep_step(5, 0))
    assert sorted(report.deleted) == sorted(dead5)
    left = [i.key for i in run_sync(store.backend.list(""))]
    assert in_step(left, 6) == in_step(keys, 6)  # step 6's dead attempt is not step 5's sweep's
    assert same(ckptio.restore(url, step=5), 5)


def test_sweep_step_finishes_an_interrupted_deletion_and_keeps_a_damaged_step(root: Path) -> None:
    store = CheckpointStore(root)
    m = run_sync(store.read_manifest("1"))
    run_sync(store.backend.create_if_absent(f"1/{TOMBSTONE_NAME}", m.checkpoint_id.encode()))
    report = run_sync(store.sweep_step(1, 0))
    assert report.finished_deletions == [1] and not (root / "1").exists()

    (root / "3" / MANIFEST_NAME).write_bytes(b"{ not a manifest")
    before = files(root)
    report = run_sync(store.sweep_step(3, 0))
    assert report.damaged == ["3"] and report.deleted == [] and files(root) == before
    assert same(ckptio.restore(root, step=2), 2)


@pytest.mark.parametrize("step", [None, -1, 2**63, True])
def test_sweep_step_needs_a_step(tmp_path: Path, step: Any) -> None:
    with pytest.raises(ValueError):
        run_sync(CheckpointStore(tmp_path).sweep_step(step, 0))


class _ScopedTemporaries(WrapperBackend):
    """A local backend whose ``sweep_temporaries`` takes a ``prefix`` (the one-step form sweep_step uses)."""

    def __init__(self, root: Path) -> None:
        super().__init__(open_backend(str(root)))
        self.root = root
        self.prefixes: list[str] = []
        self._capabilities = dataclasses.replace(self.inner.capabilities, sweeps_by_prefix=True)

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        return self._capabilities  # declared: the store reads this, never the signature

    async def sweep_temporaries(
        self, older_than_s: float, *, dry_run: bool = False, prefix: str = ""
    ) -> list[str]:
        self.prefixes.append(prefix)
        out = []
        for path in sorted((self.root / prefix).rglob(f"{TMP_MARK}*")):
            if time.time() - path.stat().st_mtime >= older_than_s:
                out.append(str(path.relative_to(self.root)))
                if not dry_run:
                    path.unlink()
        return out


def test_sweep_step_sweeps_temporaries_of_its_step_only_and_never_beside_a_live_save(root: Path) -> None:
    temps = [f"1/{TMP_MARK}a", f"2/{TMP_MARK}b", f"4/{TMP_MARK}c"]
    plant(root, temps)
    # A backend that sweeps its whole root only: the one-step sweep leaves every temporary to gc.
    assert run_sync(CheckpointStore(root).sweep_step(4, 0)).temporaries == []
    assert all((root / t).exists() for t in temps)

    scoped = _ScopedTemporaries(root)
    store = CheckpointStore(str(root), backend=scoped)
    assert run_sync(store.sweep_step(4, 0)).temporaries == [f"4/{TMP_MARK}c"]
    assert scoped.prefixes == ["4/"] and (root / temps[0]).exists() and (root / temps[1]).exists()
    # A temporary cannot say whose write it is: beside a live save, none goes.
    live_save(store, "2")
    assert run_sync(store.sweep_step(2, 0)).temporaries == [] and (root / temps[1]).exists()
