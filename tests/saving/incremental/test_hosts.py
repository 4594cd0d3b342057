"""Multi-host incremental saves (issue #37, docs/incremental.md "Many hosts"), threads as hosts.

Each host compares its own shards with its own shadows, references its own earlier objects in its
own fragment and pins them under its own save id; deleters judge such a pin by that host's
fragment. Checked: bit-exact restores of every kept step, what each save writes, retention,
delete of a base and of a referencing step, gc, ``cp`` of one step, ``verify``, and the judge.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from previous_release import previous_release, run_previous

import ckptio
from ckptio.cli import main
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME, fragment_key, unseal
from ckptio.manifest.formats import REFS_VERSION
from ckptio.manifest.names import new_id, parse_object, step_of_key
from ckptio.store import CheckpointStore
from ckptio.store.pins import PIN_DIR, parse_pin, pin_key

HOSTS = 2
N = 1 << 15  # float32 elements per host and array: 128 KiB


def frozen_of(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).standard_normal(N).astype(np.float32)


def moving_of(step: int, rank: int) -> np.ndarray:
    return np.random.default_rng(step * 10 + rank).standard_normal(N).astype(np.float32)


def host_state(step: int, rank: int, frozen: np.ndarray) -> dict[str, Any]:
    box = (slice(rank * N, (rank + 1) * N),)
    return {"frozen": ckptio.Sharded((HOSTS * N,), np.float32, [(box, frozen)]),
            "moving": ckptio.Sharded((HOSTS * N,), np.float32, [(box, moving_of(step, rank))]),
            "step": step}


def expected(step: int) -> dict[str, np.ndarray]:
    return {"frozen": np.concatenate([frozen_of(r) for r in range(HOSTS)]),
            "moving": np.concatenate([moving_of(step, r) for r in range(HOSTS)])}


def save_steps(root: Path, steps: range, max_to_keep: int | None = None) -> None:
    """A job of :data:`HOSTS` threads saving ``steps`` incrementally (the frozen array is the same
    object on each host throughout, as a frozen base is)."""
    def host(rank: int, coord: Any) -> None:
        frozen = frozen_of(rank)
        mngr = ckptio.CheckpointManager(root, coordinator=coord, incremental=True, max_to_keep=max_to_keep)
        try:
            for step in steps:
                mngr.save(step, host_state(step, rank, frozen), force=True)
                mngr.wait_until_finished()
        finally:
            mngr.close()

    on_hosts(HOSTS, host)


def assert_restores(root: Path | str, step: int) -> None:
    got, want = ckptio.restore(root, step=step), expected(step)
    for k in ("frozen", "moving"):
        assert got[k].tobytes() == want[k].tobytes(), (step, k)
    assert got["step"] == step


def loaded(root: Path, step: int) -> Any:
    store = CheckpointStore(str(root))
    try:
        return run_sync(store.read_manifest(str(step)))
    finally:
        run_sync(store.close())


def data_on_disk(root: Path) -> dict[str, int]:
    out = {}
    for p in root.rglob("*"):
        key = str(p.relative_to(root))
        if p.is_file() and (n := parse_object(key)) is not None and "fragment" not in key:
            out[key] = p.stat().st_size
            assert n.step_dir  # every data object lies in a step
    return out


def pins_on_disk(root: Path) -> set[str]:
    return {f"{PIN_DIR}/{p.name}" for p in (root / PIN_DIR).glob("*")} if (root / PIN_DIR).exists() else set()


def run(*argv: str) -> tuple[int, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, (json.loads(buf.getvalue()) if "--json" in argv and buf.getvalue() else buf.getvalue())


def test_each_host_writes_only_what_changed_and_every_kept_step_restores(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 6), max_to_keep=3)
    store = CheckpointStore(str(tmp_path))
    assert run_sync(store.committed_steps()) == [3, 4, 5]
    run_sync(store.close())
    for step in (3, 4, 5):
        assert_restores(tmp_path, step)
        m = loaded(tmp_path, step)
        assert json.loads(unseal((tmp_path / str(step) / MANIFEST_NAME).read_bytes(), "root"))["version"] >= REFS_VERSION
        assert m.bases and "1" in m.bases  # every host's frozen shard still lies in step 1
        own = [k for k in m.objects if step_of_key(k) == str(step)]
        # Each host wrote its moving shard alone (and the fragments are the only other keys).
        assert len(own) == HOSTS and all((tmp_path / k).stat().st_size == 4 * N for k in own)
        frags = {parse_object(f.key).save_id for f in m.fragments}  # type: ignore[union-attr]
        assert {pin_key("1", str(step), x) for x in frags} <= pins_on_disk(tmp_path)  # a pin per host


def test_retention_then_gc_leaves_exactly_what_kept_steps_reference(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 7), max_to_keep=2)
    store = CheckpointStore(str(tmp_path))
    run_sync(store.sweep(grace_seconds=0))
    kept = run_sync(store.committed_steps())
    assert kept == [5, 6]
    run_sync(store.close())
    named = set().union(*(set(loaded(tmp_path, s).objects) for s in kept))
    assert set(data_on_disk(tmp_path)) == named
    for s in kept:
        assert_restores(tmp_path, s)
    # The pins left are exactly the kept steps' hosts' pins on the steps they reference.
    want = {pin_key(b, str(s), parse_object(f.key).save_id)  # type: ignore[union-attr]
            for s in kept for m in [loaded(tmp_path, s)] for b in m.bases or {} for f in m.fragments or []}
    assert pins_on_disk(tmp_path) == want


def test_deleting_a_base_then_a_referencing_step_loses_nothing_kept(tmp_path: Path) -> None:
    save_steps(tmp_path, range(1, 4))
    store = CheckpointStore(str(tmp_path))
    try:
        run_sync(store.delete("1"))
        assert run_sync(store.committed_steps()) == [2, 3]
        for s in (2, 3):
            assert_restores(tmp_path, s)
        run_sync(store.delete("3"))  # every host's pins of step 3 go with it
        assert not {p for p in pins_on_disk(tmp_path) if parse_pin(p).step_dir == "3"}  # type: ignore[union-attr]
        run_sync(store.sweep(grace_seconds=0))
        assert_restores(tmp_path, 2)
        assert set(data_on_disk(tmp_path)) == set(loaded(tmp_path, 2).objects)
        run_sync(store.delete("2"))
        run_sync(store.sweep(grace_seconds=0))
        assert not data_on_disk(tmp_path) and not pins_on_disk(tmp_path)
    finally:
        run_sync(store.close())


def test_cp_of_a_referencing_step_is_self_contained_and_verify_checks_references(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_steps(src, range(1, 4))
    rc, doc = run("verify", str(src), "--step", "3", "--json")
    assert rc == 0, doc
    rc, doc = run("cp", str(src), str(dst), "--step", "3", "--json")
    assert rc == 0, doc
    m = loaded(dst, 3)
    assert not m.bases and all(step_of_key(k) == "3" for k in m.keys())
    # A referenced object of step 1 damaged in the source: verify of step 3 says so.
    key = next(k for k in loaded(src, 3).objects if step_of_key(k) == "1")
    with open(src / key, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, doc = run("verify", str(src), "--step", "3", "--json")
    assert rc != 0 and key in json.dumps(doc), doc
    shutil.rmtree(src)
    assert_restores(dst, 3)


def test_the_judge_reads_each_pinning_hosts_fragment(tmp_path: Path) -> None:
    """A deleter of step 1 keeps exactly what each host's fragment of a standing step names there, and
    a pin under a save id whose fragment the root does not list (a revoked or never-committed host)
    is dead."""
    save_steps(tmp_path, range(1, 3))
    store = CheckpointStore(str(tmp_path))
    try:
        m2 = loaded(tmp_path, 2)
        stray = new_id()
        run_sync(store.io.create_if_absent(pin_key("1", "2", stray), b""))
        judged = run_sync(store.deletion.pins.judge("1"))
        assert not judged.keep_all
        assert judged.keep == {k for k in m2.objects if step_of_key(k) == "1"} and judged.keep
        assert judged.dead == [pin_key("1", "2", stray)]
        assert fragment_key("2", stray) not in {f.key for f in m2.fragments or []}
    finally:
        run_sync(store.close())


def test_a_reader_of_format_10_refuses_a_multi_host_incremental_root(tmp_path: Path,
                                                                       monkeypatch: Any) -> None:
    """Even a save that references nothing yet: a format-10 deleter would judge every host's pin by a
    root that names no object (every referenced object dead), so it must not read one at all."""
    save_steps(tmp_path, range(1, 2))
    from ckptio.errors import ManifestError
    from ckptio.manifest import formats

    monkeypatch.setattr(formats, "VERSION", formats.HEADS_VERSION)
    store = CheckpointStore(str(tmp_path))
    try:
        try:
            run_sync(store.read_manifest("1", shards=False))
        except ManifestError as e:
            assert "version 11 is not supported" in str(e)
        else:
            raise AssertionError("a format-10 reader read a multi-host incremental root")
    finally:
        run_sync(store.close())


#: The release before multi-host incremental saves (format 10: pins, but a judge that reads roots only).
PREVIOUS = "21a8b9b"


@pytest.mark.slow
def test_the_previous_release_deletes_nothing_a_multi_host_step_references(tmp_path: Path) -> None:
    """The previous release's gc, ``delete`` of the base step 1, and gc again, on a root whose kept
    multi-host steps reference step 1: it cannot read their roots (format 11), so its judge keeps
    every object of step 1, and every step restores bit-exact with this version afterwards."""
    old = previous_release(tmp_path, PREVIOUS)
    root = tmp_path / "root"
    save_steps(root, range(1, 4))
    run_previous(old, root, [1], tmp_path, version=10, with_store="run_sync(store.sweep(0))")
    for step in (2, 3):
        assert_restores(root, step)


def test_a_paused_host_revoked_by_a_deleter_never_makes_its_references_count(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Step 3 references step 2's ``mid`` objects (every host's). Host 1 pauses after it pinned step 2,
    vouched for its references and wrote its fragment; meanwhile a deleter of step 2 finds no live save
    (the step-3 saves look paused past their lease), revokes them and takes step 2 whole. Host 1 then
    wakes and the job goes on to the root's commit: the root, which lists a revoked host's fragment,
    never counts; steps 1 restores bit-exact, and gc leaves exactly what it references."""
    from ckptio.saving.job import SaveJob

    mid = {1: 1.0, 2: 2.0, 3: 2.0}  # changes at step 2, not at step 3
    deleted: list[str] = []
    record = SaveJob.record

    def paused_record(self: SaveJob, written: Any) -> Any:
        out = record(self, written)
        if self.coord.rank == 1 and self.step == 3:
            store = CheckpointStore(str(tmp_path))

            async def nobody_alive(step_dir: str, infos: Any = None) -> set[str]:
                return set()

            store.deletion.pins.live_saves = nobody_alive  # type: ignore[method-assign]
            m3 = {p.name for p in (tmp_path / PIN_DIR).glob("2.3.*")}
            assert len(m3) == HOSTS  # every host pinned step 2 before this
            run_sync(store.delete("2"))
            run_sync(store.close())
            deleted.append("2")
        return out

    monkeypatch.setattr(SaveJob, "record", paused_record)

    def host(rank: int, coord: Any) -> list[str]:
        frozen = frozen_of(rank)
        mngr = ckptio.CheckpointManager(tmp_path, coordinator=coord, incremental=True)
        outcomes = []
        for step in (1, 2, 3):
            st = host_state(step, rank, frozen)
            st["mid"] = ckptio.Sharded((HOSTS * N,), np.float32,
                                       [((slice(rank * N, (rank + 1) * N),), np.full(N, mid[step], np.float32))])
            mngr.save(step, st, force=True)
            try:
                mngr.wait_until_finished()
                outcomes.append("committed")
            except Exception as e:  # noqa: BLE001 -- the revoked commit is the finding
                outcomes.append(type(e).__name__)
        mngr.close()
        return outcomes

    outcomes = on_hosts(HOSTS, host)
    assert deleted == ["2"]
    # The coordinator's commit finds a host's save revoked; the others learn the verdict.
    assert outcomes == [["committed", "committed", "SaveRevokedError"],
                        *[["committed", "committed", "SaveFailedError"]] * (HOSTS - 1)], outcomes
    store = CheckpointStore(str(tmp_path))
    try:
        assert run_sync(store.committed_steps()) == [1]
        assert_restores(tmp_path, 1)
        run_sync(store.sweep(grace_seconds=0))
        assert set(data_on_disk(tmp_path)) == set(loaded(tmp_path, 1).objects)
        assert not pins_on_disk(tmp_path)
    finally:
        run_sync(store.close())
