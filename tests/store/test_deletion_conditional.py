"""A deleter paused between its last re-read and its manifest's deletion never takes a re-save's commit.

The last window of :mod:`ckptio.store.deletion`: deleter D re-reads step S just before it deletes
S's manifest (checkpoint A is still there, or nothing), and pauses right there. Meanwhile another
process finishes the deletion (D's tombstone says one is under way) and saves S anew: checkpoint
B commits. D wakes and deletes "the manifest". Before the conditional delete it deleted B's: a
committed checkpoint lost. With ``Backend.delete_if`` D deletes only the version it judged, finds
B's standing and withdraws. One test per backend family that declares the capability (memory,
POSIX with hard links and without -- Parallelstore's lock-and-rename commit --, GCS, through a
proxy that makes the emulator honour ``ifGenerationMatch`` on DELETE, and S3 through fsspec,
against moto). fsspec's other protocols declare no conditional delete: there the window stays one
request wide (docs/deletion.md).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.backends import test_fsspec_backend as fsspec_tests

import ckptio
from ckptio.backends import Backend, open_backend
from ckptio.backends.wrappers import CountingBackend, WrapperBackend
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME
from ckptio.store import CheckpointStore

STEP = 7
moto_s3 = fsspec_tests.moto_s3  # the fixture: a moto S3 server for this module
MANIFEST = f"{STEP}/{MANIFEST_NAME}"


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((32, 16)).astype(np.float32), "b": rng.integers(0, 9, 50)}


def _same(a: dict[str, Any], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


class PausedAtDeletion(WrapperBackend):
    """The first deletion of ``key`` (conditional or not) waits for ``meanwhile`` (run in a thread):
    the deleter is paused between its last read of ``key`` and its deletion."""

    def __init__(self, inner: Backend, key: str, meanwhile: Callable[[], None]) -> None:
        super().__init__(inner)
        self.key, self.meanwhile, self.paused = key, meanwhile, False

    async def _maybe(self, key: str) -> None:
        if key == self.key and not self.paused:
            self.paused = True
            await asyncio.to_thread(self.meanwhile)

    async def delete(self, key: str) -> None:
        await self._maybe(key)
        await super().delete(key)

    async def delete_if(self, key: str, version: str) -> bool:
        await self._maybe(key)
        return await super().delete_if(key, version)


@pytest.fixture(params=["memory", "posix-link", "posix-lock-rename", "gcs", "fsspec-s3"])
def family(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(root URL, backend options) of one backend family that declares ``conditional_delete``."""
    kind = request.param
    if kind == "memory":
        url = f"mem://conditional-{uuid.uuid4().hex[:8]}"
        yield url, {}
        from ckptio.backends.memory import MemoryBackend

        MemoryBackend.forget(url)
    elif kind == "posix-link":
        yield str(tmp_path / "ck"), {}
    elif kind == "posix-lock-rename":
        yield str(tmp_path / "ck"), {"link_commit": False}
    elif kind == "fsspec-s3":
        endpoint = request.getfixturevalue("moto_s3")
        url = f"fsspec+s3://{fsspec_tests.S3_BUCKET}/conditional-{uuid.uuid4().hex[:8]}"
        yield url, fsspec_tests.s3_options(endpoint)
    else:
        from tests.conftest import GCS_TEST_BUCKET

        endpoint = request.getfixturevalue("gcs_preconditions")
        yield f"gs://{GCS_TEST_BUCKET}/conditional-{uuid.uuid4().hex[:8]}", {"endpoint": endpoint}


def test_a_deleter_paused_before_its_manifest_deletion_leaves_a_resave_committed_meanwhile(
        family: tuple[str, dict[str, Any]]) -> None:
    url, options = family
    ckptio.save(url, _state(1), STEP, backend_options=options).result()  # checkpoint A

    def delete_and_resave() -> None:
        other = CheckpointStore(url, backend_options=options)
        try:
            run_sync(other.delete(str(STEP)))  # finishes the deletion D's tombstone announces
        finally:
            run_sync(other.close())
        ckptio.save(url, _state(2), STEP, backend_options=options).result()  # checkpoint B commits

    backend = PausedAtDeletion(open_backend(url, **options), MANIFEST, delete_and_resave)
    assert backend.capabilities.conditional_delete
    deleter = CheckpointStore(url, backend=backend)
    try:
        run_sync(deleter.delete(str(STEP)))
    finally:
        run_sync(deleter.close())
    assert backend.paused, "the deleter never reached the pause this test is about"
    probe = open_backend(url, **options)
    assert run_sync(_exists(probe, MANIFEST)), "the paused deleter took the re-save's manifest"
    assert not run_sync(_exists(probe, f"{STEP}/{TOMBSTONE_NAME}")), "the paused deleter left a tombstone"
    restored = ckptio.restore(url, step=STEP, backend_options=options)
    assert _same(restored, _state(2)), "the re-saved checkpoint is not whole"
    manager = ckptio.CheckpointManager(url, backend_options=options)
    try:
        assert manager.latest_step() == STEP
    finally:
        manager.close()


async def _exists(backend: Backend, key: str) -> bool:
    try:
        await backend.stat(key)
        return True
    except FileNotFoundError:
        return False
    finally:
        await backend.close()


def test_a_finisher_paused_before_removing_a_stale_tombstone_spares_the_one_a_live_deleter_wrote(
        family: tuple[str, dict[str, Any]]) -> None:
    """gc or a save meets a stale tombstone (it names another checkpoint than the one committed) and
    removes it; paused just before, it must not take the tombstone a live deleter wrote meanwhile
    (without it, readers could pick a checkpoint whose objects are going away)."""
    url, options = family
    ckptio.save(url, _state(1), STEP, backend_options=options).result()
    tomb = f"{STEP}/{TOMBSTONE_NAME}"
    probe = CheckpointStore(url, backend_options=options)
    try:
        standing = run_sync(probe.manifests.read_unchecked(str(STEP))).checkpoint_id.encode()
        run_sync(probe.backend.create_if_absent(tomb, b"a-checkpoint-deleted-long-ago"))
    finally:
        run_sync(probe.close())

    def a_live_deleter_begins() -> None:
        async def swap() -> None:
            b = open_backend(url, **options)
            try:
                await b.delete(tomb)  # another finisher removed the stale one...
                await b.create_if_absent(tomb, standing)  # ...and a deletion of the standing one began
            finally:
                await b.close()

        asyncio.run(swap())

    backend = PausedAtDeletion(open_backend(url, **options), tomb, a_live_deleter_begins)
    finisher = CheckpointStore(url, backend=backend)
    try:
        run_sync(finisher.deletion.delete(str(STEP), finishing=True))
    finally:
        run_sync(finisher.close())
    assert backend.paused, "the finisher never reached the pause this test is about"
    left = run_sync(_read(open_backend(url, **options), tomb))
    assert left == standing, "the live deleter's tombstone was taken"


async def _read(backend: Backend, key: str) -> bytes | None:
    try:
        return await backend.read(key)
    except FileNotFoundError:
        return None
    finally:
        await backend.close()


# -- POSIX: the take-compare-put-back mechanics -------------------------------------------------


@pytest.mark.parametrize("link_commit", [True, False], ids=["hard-links", "lock-rename"])
def test_posix_spares_a_newer_object_under_its_name_and_leaves_no_private_copy(
        tmp_path: Path, link_commit: bool) -> None:
    from ckptio.backends._posix_conditional import TAKEN_MARK
    from ckptio.backends.local import LocalBackend

    async def body() -> None:
        b = LocalBackend(str(tmp_path), link_commit=link_commit)
        await b.create_if_absent("7/m", b"checkpoint-A")
        old = (await b.stat("7/m")).version
        await b.delete("7/m")
        await b.create_if_absent("7/m", b"checkpoint-B")
        new = await b.stat("7/m")
        assert await b.delete_if("7/m", old) is False
        assert await b.read("7/m") == b"checkpoint-B"
        # Put back, not copied: the same file (inode, size, mtime), so its version still holds.
        assert (await b.stat("7/m")).version == new.version
        assert not [n for n in os.listdir(tmp_path / "7") if TAKEN_MARK in n]
        with pytest.raises(FileExistsError):  # still committed: the commit primitive refuses
            await b.create_if_absent("7/m", b"checkpoint-C")
        assert await b.delete_if("7/m", new.version) is True
        assert not (tmp_path / "7").exists(), "the emptied step directory (and commit lock) stayed"
        await b.close()

    asyncio.run(body())


@pytest.mark.parametrize("how", ["link", "renameat2", "check-then-rename"])
def test_posix_put_back_never_replaces_an_object_created_meanwhile(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from ckptio.backends import _posix_conditional as pc

    if how == "check-then-rename":
        monkeypatch.setattr(pc, "_renameat2", lambda: None)
    aside, path = tmp_path / f"{pc.TAKEN_MARK}x", tmp_path / "m"
    aside.write_bytes(b"set aside")
    path.write_bytes(b"created meanwhile")
    pc._put_back(str(aside), str(path), hard_links=how == "link")
    assert path.read_bytes() == b"created meanwhile"
    assert aside.read_bytes() == b"set aside", "the object set aside was lost"
    assert "kept as" in caplog.text
    path.unlink()
    pc._put_back(str(aside), str(path), hard_links=how == "link")
    assert path.read_bytes() == b"set aside" and not aside.exists()


@pytest.mark.parametrize("hard_links", [True, False], ids=["link", "rename-noreplace"])
def test_posix_an_object_replaced_between_compare_and_take_is_put_back(
        tmp_path: Path, hard_links: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one interleaving where the take meets a newer object: it replaced the judged one between
    the first compare (lstat) and the take (rename). It goes back under its name, whole."""
    from ckptio.backends import _posix_conditional as pc

    path = tmp_path / "m"
    path.write_bytes(b"checkpoint-A")
    judged = pc.file_version(os.lstat(path))
    real_rename = os.rename

    def replaced_first(src: Any, dst: Any) -> None:
        if os.fspath(src) == str(path):
            path.unlink()
            path.write_bytes(b"checkpoint-B!")  # another process: delete and re-create (another size:
            # this test is about the put-back, not about telling a reused inode apart)
        real_rename(src, dst)

    monkeypatch.setattr(pc.os, "rename", replaced_first)
    assert pc.take_if(str(path), judged, hard_links=hard_links, dir_fsync=True) is False
    monkeypatch.setattr(pc.os, "rename", real_rename)
    assert path.read_bytes() == b"checkpoint-B!"
    assert os.listdir(tmp_path) == ["m"], "the taken object left a private copy behind"


def test_a_wrapper_that_changes_delete_but_not_delete_if_offers_no_conditional_delete() -> None:
    """Else conditional deletes would bypass what it does to deletes (a test's injected crash, a log)."""
    from ckptio.backends.memory import MemoryBackend

    class OnlyDelete(WrapperBackend):
        async def delete(self, key: str) -> None:
            await super().delete(key)

    class Both(OnlyDelete):
        async def delete_if(self, key: str, version: str) -> bool:
            return await super().delete_if(key, version)

    class CountingThenOnlyDelete(CountingBackend):  # delete changed after the class that wrapped both
        async def delete(self, key: str) -> None:
            await super().delete(key)

    inner = MemoryBackend(f"mem://wrap-{uuid.uuid4().hex[:8]}")
    assert CountingBackend(inner).capabilities.conditional_delete
    assert not CountingThenOnlyDelete(inner).capabilities.conditional_delete
    assert WrapperBackend(inner).capabilities.conditional_delete
    assert not OnlyDelete(inner).capabilities.conditional_delete
    assert Both(inner).capabilities.conditional_delete
    assert PausedAtDeletion(inner, MANIFEST, lambda: None).capabilities.conditional_delete
    MemoryBackend.forget(inner.url)
