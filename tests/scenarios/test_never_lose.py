"""Issue 13: nothing deletes what is not ckptio's, nothing committed is ever lost or mis-read.

One test (or a parametrised family) per finding; each failed on the tree before the fix.
The same properties for the tombstone, commit-vs-gc and hashed-orphan findings run on
fake-gcs-server at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.conftest import GCS_TEST_BUCKET
from manifests import as_rows

import ckptio
from ckptio.backends.wrappers import WrapperBackend
from ckptio.cli import main as cli
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME
from ckptio.manifest.names import parse_object
from ckptio.store import CheckpointStore


def state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 33)).astype(np.float32), "b": rng.integers(0, 9, 1000), "step": step}


def same(got: dict[str, Any], step: int) -> bool:
    want = state(step)
    return got["step"] == step and all(got[k].tobytes() == want[k].tobytes() for k in ("w", "b"))


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def save(url: Any, step: int, **kw: Any) -> None:
    ckptio.save(url, state(step), step=step, **kw).result()


# -- 1. gc deletes only what is provably ckptio's ---------------------------------------------------

FOREIGN = ["hf/config.json", "head/notes.txt", "hdf5/x.h5", "2024/results.csv", "100/README.txt",
           "h3f/readme.md", "1/extra/data.bin", "1/notes.txt"]


def test_gc_spares_foreign_files_in_lookalike_directories(tmp_path: Path) -> None:
    save(tmp_path, 1)
    for name in FOREIGN:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("not ckptio's")
    old = time.time() - 7200
    for name in FOREIGN:
        os.utime(tmp_path / name, (old, old))
    assert cli(["gc", str(tmp_path), "--grace", "0"]) == 0
    assert all((tmp_path / n).exists() for n in FOREIGN)
    assert same(ckptio.restore(tmp_path, step=1), 1)


def test_gc_spares_orbax_steps_and_in_item_ckptio_checkpoints(tmp_path: Path) -> None:
    # The ckptio.orbax default layout: a ckptio checkpoint at <root>/<step>/<item>, beside Orbax's files.
    ckptio.save(tmp_path / "1" / "default", state(1)).result()
    (tmp_path / "1" / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "2" / "default").mkdir(parents=True)
    (tmp_path / "2" / "default" / "ocdbt.process_0").write_text("stock orbax data")
    before = files(tmp_path)
    assert cli(["gc", str(tmp_path), "--grace", "0"]) == 0
    assert files(tmp_path) == before
    assert same(ckptio.restore(tmp_path / "1" / "default"), 1)


def test_gc_one_level_too_high_spares_nested_roots(tmp_path: Path) -> None:
    save(tmp_path / "runA", 5)
    ckptio.save(tmp_path / "100", state(7)).result()  # a nested root that looks like a step directory
    save(tmp_path / "7", 3)  # a nested root whose own steps look like ours
    before = files(tmp_path)
    assert cli(["gc", str(tmp_path), "--grace", "0"]) == 0
    assert files(tmp_path) == before
    assert same(ckptio.restore(tmp_path / "100"), 7) and same(ckptio.restore(tmp_path / "7", step=3), 3)


def test_gc_dry_run_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(tmp_path, 1)
    orphan = tmp_path / "2" / "0123456789ab.h00000-00000"
    orphan.parent.mkdir()
    orphan.write_bytes(b"x" * 10)
    assert cli(["gc", str(tmp_path), "--grace", "0", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dry_run"] and doc["objects"] == ["2/0123456789ab.h00000-00000"] and doc["bytes"] == 10
    assert orphan.exists()
    assert cli(["gc", str(tmp_path), "--grace", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["objects"] == ["2/0123456789ab.h00000-00000"]
    assert not orphan.exists() and same(ckptio.restore(tmp_path), 1)


# -- 2. a leftover tombstone never swallows a re-save -------------------------------------------------

def _kill_delete_after_manifest(url: str, step: int) -> None:
    """What a deleter killed between removing the manifest and removing the tombstone leaves."""
    store = CheckpointStore(url)
    m = run_sync(store.read_manifest(str(step)))
    run_sync(store.backend.create_if_absent(f"{step}/{TOMBSTONE_NAME}", m.checkpoint_id.encode()))
    for key in [*m.objects, f"{step}/{MANIFEST_NAME}"]:
        run_sync(store.backend.delete(key))
    run_sync(store.close())


def _kill_delete_after_tombstone(url: str, step: int) -> None:
    store = CheckpointStore(url)
    run_sync(store.backend.create_if_absent(f"{step}/{TOMBSTONE_NAME}", b""))
    run_sync(store.close())


def tombstone_case(url: str, kill: Any) -> None:
    save(url, 1)
    kill(url, 1)
    save(url, 1)  # committed: and it must really be
    mngr = ckptio.CheckpointManager(url)
    assert mngr.all_steps() == [1]
    assert same(mngr.restore(1), 1)
    mngr.sweep_orphans(grace_seconds=0)
    assert same(mngr.restore(1), 1)
    mngr.close()


@pytest.mark.parametrize("kill", [_kill_delete_after_manifest, _kill_delete_after_tombstone])
def test_leftover_tombstone_is_finished_by_a_resave(tmp_path: Path, kill: Any) -> None:
    tombstone_case(str(tmp_path), kill)


# -- 3. a commit checks that its objects still exist --------------------------------------------------

class _BeforeCommit(WrapperBackend):
    """Runs ``hook`` once, just before the manifest is created (a slow commit meeting another actor)."""

    def __init__(self, inner: Any, hook: Any) -> None:
        super().__init__(inner)
        self.hook = hook

    async def create_if_absent(self, key: str, data: bytes) -> None:
        if key.endswith(MANIFEST_NAME) and self.hook is not None:
            hook, self.hook = self.hook, None
            await hook()
        await super().create_if_absent(key, data)


def test_gc_during_a_slow_commit_spares_the_save(tmp_path: Path) -> None:
    url = str(tmp_path)
    save(url, 1)

    async def gc() -> None:
        report = await CheckpointStore(url).sweep(0)
        assert report.spared_in_flight > 0 and not report.objects

    backend = _BeforeCommit(ckptio.backends.open_backend(url), gc)
    ckptio.save(url, state(2), step=2, backend=backend).result()
    assert ckptio.CheckpointManager(url).all_steps() == [1, 2]
    assert same(ckptio.restore(url), 2)


def test_commit_refuses_when_an_object_vanished(tmp_path: Path) -> None:
    url = str(tmp_path)

    async def lose_one() -> None:
        inner = ckptio.backends.open_backend(url)
        victim = next(i.key for i in await inner.list("3/") if parse_object(i.key))
        await inner.delete(victim)

    class LoseAfterSync(WrapperBackend):  # the objects are written and synced; then one vanishes
        async def sync(self) -> None:
            await super().sync()
            await lose_one()

    backend = LoseAfterSync(ckptio.backends.open_backend(url))
    with pytest.raises(FileNotFoundError, match="is missing"):
        ckptio.save(url, state(3), step=3, backend=backend).result()
    assert ckptio.CheckpointManager(url).all_steps() == []
    assert not (tmp_path / "3" / MANIFEST_NAME).exists()


def test_rm_rf_root_midway_fails_the_save(tmp_path: Path) -> None:
    root = tmp_path / "run"

    class RmAfterFirstWrite(WrapperBackend):
        done = False

        async def write(self, key: str, buffers: Any) -> None:
            await super().write(key, buffers)
            if parse_object(key) and not self.done:
                self.done = True
                shutil.rmtree(root)

    big = {f"w{i}": np.full(1 << 18, i, np.float32) for i in range(8)}
    backend = RmAfterFirstWrite(ckptio.backends.open_backend(str(root), object_size=1 << 20))
    # OSError: the rm -rf itself can fail ("Directory not empty") racing the save's other writes;
    # it has unlinked the first object by then, so the save must fail either way.
    with pytest.raises((OSError, ckptio.SaveFailedError)):
        ckptio.save(root, big, step=1, backend=backend).result()
    assert ckptio.CheckpointManager(root).all_steps() == []


def test_resumed_copy_survives_a_concurrent_gc(tmp_path: Path) -> None:
    from ckptio.manage.copying import copy_checkpoint, copy_objects, rekey

    src, dst_url = str(tmp_path / "src"), str(tmp_path / "dst")
    save(src, 4)
    s, d = CheckpointStore(src), CheckpointStore(dst_url)
    m = run_sync(s.read_manifest("4"))
    run_sync(copy_objects(s, d, m, rekey(m, "4", d)))  # a first attempt that died before its commit
    old = time.time() - 7200
    for p in (tmp_path / "dst").rglob("*"):
        os.utime(p, (old, old))

    async def gc() -> None:
        report = await CheckpointStore(dst_url).sweep()  # the default grace: the old objects qualify
        assert not report.objects

    d2 = CheckpointStore(dst_url, backend=_BeforeCommit(ckptio.backends.open_backend(dst_url), gc))
    out, stats = run_sync(copy_checkpoint(s, d2, "4"))
    assert stats.kept == len(out.objects)
    assert same(ckptio.restore(dst_url, step=4), 4)


# -- 4. deletion never escapes the step ----------------------------------------------------------------

def test_symlinked_step_is_neither_listed_read_nor_deleted_through(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    save(elsewhere, 5)
    (elsewhere / "5" / "user.txt").write_text("mine")
    before = files(elsewhere)
    save(root, 1)
    (root / "5").symlink_to(elsewhere / "5")
    mngr = ckptio.CheckpointManager(root, max_to_keep=1)
    assert mngr.all_steps() == [1]
    with pytest.raises(PermissionError, match="symbolic link"):
        ckptio.restore(root, step=5)
    mngr.save(6, state(6)).result()
    mngr.sweep_orphans(grace_seconds=0)
    mngr.close()
    with pytest.raises(PermissionError):
        run_sync(CheckpointStore(root).delete("5"))
    assert files(elsewhere) == before


def test_copied_step_directory_is_damaged_and_deleting_it_spares_the_original(tmp_path: Path) -> None:
    save(tmp_path, 1)
    shutil.copytree(tmp_path / "1", tmp_path / "2")
    with pytest.raises(ckptio.ManifestError, match="step 1, not 2"):
        ckptio.restore(tmp_path, step=2)
    store = CheckpointStore(tmp_path)
    assert run_sync(store.status("2")).state == "damaged"
    run_sync(store.delete("2"))
    assert not (tmp_path / "2").exists()
    assert same(ckptio.restore(tmp_path, step=1), 1)
    assert ckptio.CheckpointManager(tmp_path).all_steps() == [1]


# -- 5. a manifest is bound to its place ---------------------------------------------------------------

def test_manifest_moved_into_another_step_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(tmp_path, 1)
    save(tmp_path, 2)
    shutil.copy(tmp_path / "2" / MANIFEST_NAME, tmp_path / "1" / MANIFEST_NAME)
    with pytest.raises(ckptio.ManifestError, match="for step 2, not 1"):
        ckptio.restore(tmp_path, step=1)
    assert cli(["verify", str(tmp_path), "--step", "1"]) == 4  # damaged, said in one line
    assert "for step 2, not 1" in capsys.readouterr().err


# -- 6. a bad manifest breaks one step, not the root ---------------------------------------------------

def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_damaged_newest_step_is_skipped_listed_and_never_counted_as_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    for s in (4, 6, 7, 8):
        save(tmp_path, s)
    _flip(tmp_path / "8" / MANIFEST_NAME)
    with caplog.at_level(logging.WARNING):
        got = ckptio.restore(tmp_path)
    assert same(got, 7) and "step 8 is damaged" in caplog.text
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" in out and out.count("committed") == 3
    assert cli(["gc", str(tmp_path), "--grace", "0"]) == 0
    assert "damaged step 8" in capsys.readouterr().out
    mngr = ckptio.CheckpointManager(tmp_path, max_to_keep=3)
    assert mngr.latest_step() == 7
    mngr.save(9, state(9)).result()
    mngr.close()
    assert CheckpointManagerSteps(tmp_path) == [6, 7, 8, 9]  # 8 (damaged) left alone, 3 intact kept
    assert all(same(ckptio.restore(tmp_path, step=s), s) for s in (6, 7, 9))


def CheckpointManagerSteps(root: Path) -> list[int]:
    return ckptio.CheckpointManager(root).all_steps()


def test_deeply_nested_manifest_is_a_manifest_error(tmp_path: Path) -> None:
    from ckptio.manifest import seal

    save(tmp_path, 1)
    from ckptio.system.checksum import crc32c

    body = b'{"format":"ckptio","version":1,"tree":' + b"[" * 5000 + b"0" + b"]" * 5000 + b"}"
    sealed = b'{"crc32c":"%08x","manifest":%s}' % (crc32c(body), body)
    assert seal({"a": 1}).startswith(b'{"crc32c":"')  # the same sealed form as the writer's
    (tmp_path / "1" / MANIFEST_NAME).write_bytes(sealed)
    with pytest.raises(ckptio.ManifestError):
        ckptio.restore(tmp_path, step=1)
    assert run_sync(CheckpointStore(tmp_path).status("1")).state == "damaged"


# -- 7. latest-step races ------------------------------------------------------------------------------

class _DeleteWhileReading(WrapperBackend):
    """The first data read of step ``victim`` deletes that step first (a retention racing a reader)."""

    def __init__(self, inner: Any, url: str, victim: int) -> None:
        super().__init__(inner)
        self.root_url, self.victim, self.fired = url, victim, False

    async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
        if not self.fired and key.startswith(f"{self.victim}/") and parse_object(key):
            self.fired = True
            await CheckpointStore(self.root_url).delete(str(self.victim))
        await super().read_into(key, rng, buffers)


def test_restore_latest_that_loses_a_race_with_deletion_takes_the_next(tmp_path: Path) -> None:
    url = str(tmp_path)
    save(url, 5)
    save(url, 6)
    got = ckptio.restore(url, backend=_DeleteWhileReading(ckptio.backends.open_backend(url), url, 6))
    assert same(got, 5)
    save(url, 7)
    with pytest.raises(ckptio.CheckpointNotFoundError, match="step 7 was deleted while being restored"):
        ckptio.restore(url, step=7, backend=_DeleteWhileReading(ckptio.backends.open_backend(url), url, 7))


# -- 8. resource bombs ---------------------------------------------------------------------------------

def test_huge_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    save(tmp_path, 1)
    with open(tmp_path / "1" / MANIFEST_NAME, "r+b") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that cost no disk
    with pytest.raises(ckptio.ManifestError, match="exceeds"):
        ckptio.restore(tmp_path, step=1)


def test_declared_shape_is_not_allocated_before_objects_are_checked(tmp_path: Path) -> None:
    from ckptio.manifest import row_object, seal, unseal

    save(tmp_path, 1)
    path = tmp_path / "1" / MANIFEST_NAME
    doc = as_rows(json.loads(unseal(path.read_bytes(), "m")))  # a packed member as a format-4 row
    item = doc["items"]["w"]
    if isinstance(item, list):  # a small array's compact row: edited in its full form
        item = doc["items"]["w"] = row_object(item)
    n = 1 << 40  # 4 TiB of float32
    item["shape"] = [n]
    item["shards"] = [{"offsets": [0], "shape": [n], "host": 0,
                       "extents": [[0, 0, 0, 4 * n, [0] * (4 * n // doc["block_size"])]]}]
    doc["tree"]["dict"]["w"] = {"leaf": "w"}
    path.write_bytes(seal(doc))
    with pytest.raises(ckptio.IntegrityError, match="its extents need"):
        ckptio.restore(tmp_path, step=1)


# -- 9. orphans of killed attempts go with their step on hashed layouts --------------------------------

class _RefuseCommit(WrapperBackend):
    async def create_if_absent(self, key: str, data: bytes) -> None:
        if key.endswith(MANIFEST_NAME):
            raise ConnectionAbortedError("killed before its commit")
        await super().create_if_absent(key, data)


def hashed_orphans_case(url: str, monkeypatch: pytest.MonkeyPatch) -> CheckpointStore:
    monkeypatch.setenv("CKPTIO_LEASE_S", "0.4")
    naming = HashedNaming()
    with pytest.raises(ConnectionAbortedError):
        ckptio.save(url, state(95), step=95, naming=naming,
                    backend=_RefuseCommit(ckptio.backends.open_backend(url))).result()
    time.sleep(0.5)  # the killed attempt's lease runs out
    mngr = ckptio.CheckpointManager(url, max_to_keep=1, naming=naming)
    mngr.save(95, state(95)).result()
    mngr.save(96, state(96)).result()
    mngr.close()
    store = CheckpointStore(url)
    assert run_sync(store.committed_steps()) == [96]
    return store


def test_deleting_a_step_removes_killed_attempts_on_hashed_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = hashed_orphans_case(str(tmp_path), monkeypatch)
    left = [i.key for i in run_sync(store.backend.list("")) if "/95/" in i.key or i.key.startswith("95/")]
    assert left == []


# -- 10. refusals come before any byte is written, and say so ------------------------------------------

@pytest.mark.parametrize("step", [2**63, -1, True, 1.5])
def test_bad_steps_are_refused_before_writing(tmp_path: Path, step: Any) -> None:
    with pytest.raises(ValueError, match="step must be"):
        ckptio.save(tmp_path, state(1), step=step)
    assert files(tmp_path) == set()


def test_oversized_int_leaf_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="big.*too large"):
        ckptio.save(tmp_path, {"w": np.ones(4), "big": 10**4000}, step=1)
    assert files(tmp_path) == set()


def test_empty_url_is_refused() -> None:
    with pytest.raises(ValueError, match="URL is empty"):
        ckptio.save("", state(1), step=1)


def test_skipped_and_doomed_saves_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mngr = ckptio.CheckpointManager(tmp_path, max_to_keep=1)
    mngr.save(5, state(5)).result()
    with caplog.at_level(logging.INFO, logger="ckptio.manager"):
        assert mngr.save(3, state(3)) is None
        assert "step 3 not saved" in caplog.text
        mngr.save(4, state(4), force=True).result()
        assert "deletes it right after its commit" in caplog.text
    mngr.close()


# -- the same on fake-gcs-server -----------------------------------------------------------------------

def _gs(tmp_path: Path) -> str:
    return f"gs://{GCS_TEST_BUCKET}/{str(tmp_path).strip('/')}"


@pytest.mark.gcs
def test_gcs_leftover_tombstone(gcs_emulator_env: str, tmp_path: Path) -> None:
    tombstone_case(_gs(tmp_path), _kill_delete_after_manifest)


@pytest.mark.gcs
def test_gcs_gc_during_a_slow_commit(gcs_emulator_env: str, tmp_path: Path) -> None:
    url = _gs(tmp_path)

    async def gc() -> None:
        report = await CheckpointStore(url).sweep(0)
        assert report.spared_in_flight > 0 and not report.objects

    ckptio.save(url, state(2), step=2, backend=_BeforeCommit(ckptio.backends.open_backend(url), gc)).result()
    assert same(ckptio.restore(url), 2)


@pytest.mark.gcs
def test_gcs_hashed_orphans_go_with_their_step(gcs_emulator_env: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = hashed_orphans_case(_gs(tmp_path), monkeypatch)
    keys = [i.key for i in run_sync(store.backend.list(""))]
    assert not [k for k in keys if "/95/" in k or k.startswith("95/")], keys
    run_sync(store.close())


def test_pinwheel_tilings_validate_without_pairwise_work() -> None:
    """A valid non-grid tiling (3x3 pinwheels) used to make validation superlinear (128k shards: 195 s)."""
    from ckptio.manifest import first_overlap

    def pinwheel(x: int, y: int) -> list[Any]:
        return [((x, y), (2, 1)), ((x + 2, y), (1, 2)), ((x + 1, y + 2), (2, 1)), ((x, y + 1), (1, 2)),
                ((x + 1, y + 1), (1, 1))]

    boxes = [b for x in range(0, 240, 3) for y in range(0, 240, 3) for b in pinwheel(x, y)]
    assert len(boxes) == 32000 and first_overlap(boxes) is None
    assert first_overlap([*boxes, ((4, 4), (2, 2))]) is not None


def test_core_restore_never_narrows_64_bit_values_silently_into_jax(tmp_path: Path) -> None:
    """The core twin of issue 20's finding 1: jax without x64 cannot hold int64 values past 2**31."""
    jax = pytest.importorskip("jax")
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on in this process")
    ckptio.save(tmp_path, {"big": np.array([1, 2**40 + 1], np.int64), "small": np.arange(3)}, step=1).result()
    target = {"big": jax.ShapeDtypeStruct((2,), np.int64), "small": jax.ShapeDtypeStruct((3,), np.int64)}
    with pytest.raises(ValueError, match="'big'.*jax_enable_x64"):
        ckptio.restore(tmp_path, step=1, target=target)
    got = ckptio.restore(tmp_path, step=1, target={"small": target["small"]})
    assert np.asarray(got["small"]).tolist() == [0, 1, 2]  # values jax can hold come back intact


def test_gc_finishes_a_deletion_that_died_after_its_objects(tmp_path: Path) -> None:
    """Found by the 100-trial campaign: a step holding only its manifest and tombstone was never finished."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    store = CheckpointStore(tmp_path)
    m = run_sync(store.read_manifest("1"))
    run_sync(store.backend.create_if_absent(f"1/{TOMBSTONE_NAME}", m.checkpoint_id.encode()))
    for key in m.objects:
        run_sync(store.backend.delete(key))
    report = run_sync(store.sweep(0))
    assert report.finished_deletions == [1] and not (tmp_path / "1").exists()
    assert same(ckptio.restore(tmp_path), 2)
