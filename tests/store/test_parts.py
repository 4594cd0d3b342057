"""A host's part committed by a record and a fence, without the manifest (ckptio.store.parts, #33).

What decides whether data can be lost: a part counts only once its fence says "commit"; deletion takes
its objects, then its record, then its fence; gc keeps what a standing record names and takes a record
whose fence does not stand; a paused committer, a paused deleter and a re-save of the step each end
with either the part whole and committed, or nothing of it counted.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from ckptio.backends import open_backend
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import SaveRevokedError
from ckptio.manifest.names import fence_key, new_id, parse_held
from ckptio.store import CheckpointStore
from ckptio.store.parts import PartRecord, part_from_json

HOST = 3


def store(root, backend=None) -> CheckpointStore:
    return CheckpointStore(str(root), backend=backend, host_local=True)


def write_part(st: CheckpointStore, step: int, n: int = 3, size: int = 100) -> PartRecord:
    """A save's objects of this host in ``step`` (not committed), and the record that would commit them."""
    sid = new_id()
    keys = [f"{step}/{sid}.h{HOST:05d}-{i:05d}" for i in range(n)]
    root = st.url.removeprefix("file://")
    os.makedirs(os.path.join(root, str(step)), exist_ok=True)
    for i, k in enumerate(keys):  # plain files: also callable from inside the IO loop (a paused process's peer)
        with open(os.path.join(root, k), "wb") as f:
            f.write(bytes([i]) * size)
    return PartRecord(step, new_id(), HOST, new_id(), 8, keys, [size] * n, {"extents": [[[0, size]]] * n})


def listed(root, step: int) -> list[str]:
    d = root / str(step)
    return sorted(os.listdir(d)) if d.exists() else []


def age(root, step: int, seconds: float = 7200) -> None:
    """Make everything in ``step`` look ``seconds`` old (gc's grace)."""
    t = time.time() - seconds
    for n in listed(root, step):
        os.utime(root / str(step) / n, (t, t))


def test_a_part_counts_once_its_fence_says_commit(tmp_path):
    st = store(tmp_path)
    rec = write_part(st, 5)
    assert not run_sync(st.is_committed("5"))
    run_sync(st.parts.commit(rec))
    assert run_sync(st.is_committed("5")) and run_sync(st.committed_steps()) == [5]
    back = part_from_json((tmp_path / rec.key).read_bytes(), rec.key)
    assert back == rec  # key, size and the caller's extents, as written
    # the same step in a store that is not host-local: a record is no commit there
    assert not run_sync(CheckpointStore(str(tmp_path)).is_committed("5"))


def test_a_record_without_its_fence_commits_nothing_and_gc_takes_it(tmp_path):
    st = store(tmp_path)
    rec = write_part(st, 5)
    run_sync(st.io.write(rec.key, [memoryview(rec.to_json())]))  # the committer died before its claim
    assert not run_sync(st.is_committed("5")) and run_sync(st.committed_steps()) == []
    age(tmp_path, 5)
    run_sync(st.sweep())
    assert listed(tmp_path, 5) == []  # its fence claimed "revoked" by gc, then taken after the record


def test_gc_keeps_a_standing_part_whatever_its_age(tmp_path):
    st = store(tmp_path)
    rec = write_part(st, 5)
    run_sync(st.parts.commit(rec))
    before = listed(tmp_path, 5)
    age(tmp_path, 5)
    report = run_sync(st.sweep(grace_seconds=0))
    assert report.objects == [] and listed(tmp_path, 5) == before
    assert run_sync(st.is_committed("5"))


@pytest.mark.parametrize("damage", ["not_json", "another_step", "short_sizes", "object_outside"])
def test_a_damaged_record_commits_nothing_and_gc_keeps_its_step(tmp_path, damage):
    st = store(tmp_path)
    rec = write_part(st, 5)
    run_sync(st.parts.commit(rec))
    doc = json.loads(rec.to_json())
    if damage == "not_json":
        data = rec.to_json()[:-7]
    else:
        if damage == "another_step":
            doc["step"] = 6
        elif damage == "short_sizes":
            doc["sizes"] = doc["sizes"][:-1]
        else:
            doc["objects"][0] = "6/" + doc["objects"][0].split("/")[1]
        data = json.dumps(doc).encode()
    (tmp_path / rec.key).write_bytes(data)
    with pytest.raises(ValueError, match="ckptio.held"):
        part_from_json(data, rec.key)
    assert not run_sync(st.is_committed("5"))
    before = listed(tmp_path, 5)
    age(tmp_path, 5)
    run_sync(st.sweep(grace_seconds=0))
    assert listed(tmp_path, 5) == before  # it may be the only proof of a committed part: nothing taken
    run_sync(st.delete("5"))  # deletion by name still clears the step
    assert listed(tmp_path, 5) == []


def test_commit_refuses_a_missing_or_short_object(tmp_path):
    st = store(tmp_path)
    rec = write_part(st, 5)
    os.truncate(tmp_path / rec.objects[1], 10)
    with pytest.raises(Exception, match="100"):
        run_sync(st.parts.commit(rec))
    os.remove(tmp_path / rec.objects[1])
    with pytest.raises(FileNotFoundError):
        run_sync(st.parts.commit(rec))
    assert not run_sync(st.is_committed("5")) and not (tmp_path / rec.key).exists()


class _Order(WrapperBackend):
    """Records the order of deletes."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.deleted: list[str] = []

    async def delete(self, key: str) -> None:
        self.deleted.append(key)
        await self.inner.delete(key)


def test_deletion_takes_objects_then_the_record_then_the_fence(tmp_path):
    backend = _Order(open_backend(str(tmp_path)))
    st = store(tmp_path, backend)
    rec = write_part(st, 5)
    run_sync(st.parts.commit(rec))
    run_sync(st.delete("5"))
    assert listed(tmp_path, 5) == [] and not run_sync(st.is_committed("5"))
    order = backend.deleted
    at = {k: order.index(k) for k in [*rec.objects, rec.key, fence_key("5", rec.fence), "5/ckptio.deleting"]}
    assert max(at[k] for k in rec.objects) < at[rec.key] < at[fence_key("5", rec.fence)] < at["5/ckptio.deleting"]


class _DiesAt(WrapperBackend):
    """A deletion killed when it reaches the first key ``predicate`` picks."""

    def __init__(self, inner, predicate) -> None:
        super().__init__(inner)
        self.predicate = predicate

    async def delete(self, key: str) -> None:
        if self.predicate(key):
            raise OSError(f"killed before deleting {key}")
        await self.inner.delete(key)


@pytest.mark.parametrize("at", ["record", "fence"])
def test_a_deletion_killed_midway_never_leaves_a_part_that_counts(tmp_path, at):
    rec = write_part(store(tmp_path), 5)
    run_sync(store(tmp_path).parts.commit(rec))
    dies = (lambda k: parse_held(k) is not None) if at == "record" else (lambda k: "ckptio.fence." in k)
    with pytest.raises(OSError, match="killed"):
        run_sync(store(tmp_path, _DiesAt(open_backend(str(tmp_path)), dies)).delete("5"))
    left = listed(tmp_path, 5)
    assert not any(k.split("/")[1] in left for k in rec.objects)  # its objects went first
    assert "ckptio.deleting" in left and not run_sync(store(tmp_path).is_committed("5"))
    run_sync(store(tmp_path).delete("5"))  # the next deletion (or a save of the step) finishes it
    assert listed(tmp_path, 5) == []


class _PausedAt(WrapperBackend):
    """Pauses the first create of ``key``: runs ``meanwhile`` (another process's work) first."""

    def __init__(self, inner, key: str, meanwhile) -> None:
        super().__init__(inner)
        self.key, self.meanwhile = key, meanwhile

    async def create_if_absent(self, key: str, data: bytes) -> None:
        if key == self.key and self.meanwhile is not None:
            todo, self.meanwhile = self.meanwhile, None
            await todo()
        await self.inner.create_if_absent(key, data)


def test_a_committer_paused_before_its_claim_cannot_commit_what_a_deleter_took(tmp_path):
    rec = write_part(store(tmp_path), 5)
    other = store(tmp_path)
    paused = store(tmp_path, _PausedAt(open_backend(str(tmp_path)), fence_key("5", rec.fence),
                                       lambda: other.delete("5")))
    with pytest.raises(SaveRevokedError):
        run_sync(paused.parts.commit(rec))
    assert not run_sync(store(tmp_path).is_committed("5"))
    assert not any(n.endswith(tuple(k.split("/")[1] for k in rec.objects)) for n in listed(tmp_path, 5))


def test_a_committer_paused_before_its_claim_meets_gc(tmp_path):
    rec = write_part(store(tmp_path), 5)
    age(tmp_path, 5)
    other = store(tmp_path)

    async def gc() -> None:
        age(tmp_path, 5)  # its record too: written just now, as old as the grace by the time gc runs
        await other.sweep(grace_seconds=0)

    paused = store(tmp_path, _PausedAt(open_backend(str(tmp_path)), fence_key("5", rec.fence), gc))
    with pytest.raises(SaveRevokedError):
        run_sync(paused.parts.commit(rec))
    assert not run_sync(store(tmp_path).is_committed("5"))
    assert not any(os.path.exists(tmp_path / k) for k in rec.objects)


def test_a_paused_deleter_waking_after_a_resave_takes_only_the_old_part(tmp_path):
    """Deleter A settles the old part and creates its tombstone, then pauses; another deleter finishes,
    and the step is re-saved and committed (new save, new record, new fence); A wakes and lists: it
    takes nothing of the new part."""
    old = write_part(store(tmp_path), 5)
    run_sync(store(tmp_path).parts.commit(old))
    box: dict[str, PartRecord] = {}

    async def meanwhile() -> None:
        other = store(tmp_path)
        await other.delete("5")
        new = write_part(other, 5)
        await other.parts.commit(new)
        box["new"] = new

    paused = store(tmp_path, _PausedAt(open_backend(str(tmp_path)), "5/ckptio.deleting", meanwhile))
    run_sync(paused.delete("5"))
    new = box["new"]
    assert run_sync(store(tmp_path).is_committed("5"))
    assert all(os.path.getsize(tmp_path / k) == 100 for k in new.objects)
    assert part_from_json((tmp_path / new.key).read_bytes(), new.key) == new
    assert (tmp_path / fence_key("5", new.fence)).read_bytes() == b"commit"
    assert not (tmp_path / old.key).exists() and not any(os.path.exists(tmp_path / k) for k in old.objects)


def test_a_part_committed_while_a_deletion_runs_stays_whole(tmp_path):
    """A re-save's objects are in before the deleter lists the step; its record lands after the listing
    and its claim wins (it checked for revocations before the deleter revoked): the deleter reads the
    records again after revoking, finds the part standing, and takes nothing of it."""
    old = write_part(store(tmp_path), 5)
    run_sync(store(tmp_path).parts.commit(old))
    other = store(tmp_path)
    new = write_part(other, 5)
    age(tmp_path, 5)

    class _AfterListing(WrapperBackend):
        fired = False

        async def list(self, prefix: str = ""):
            out = await self.inner.list(prefix)
            if prefix == "5/" and any(i.key.endswith("ckptio.deleting") for i in out) and not self.fired:
                self.fired = True
                (tmp_path / "5" / "ckptio.deleting").rename(tmp_path / "aside")  # the committer saw none
                await other.parts.commit(new)
                (tmp_path / "aside").rename(tmp_path / "5" / "ckptio.deleting")
            return out

    run_sync(store(tmp_path, _AfterListing(open_backend(str(tmp_path)))).delete("5"))
    assert run_sync(store(tmp_path).is_committed("5"))
    assert all(os.path.getsize(tmp_path / k) == 100 for k in new.objects)
    assert not any(os.path.exists(tmp_path / k) for k in old.objects) and not (tmp_path / old.key).exists()


def test_gc_never_revokes_a_part_whose_save_is_alive(tmp_path):
    """A committer that wrote its record and is still alive (its intent beats), however old its keys
    look: gc claims nothing and takes nothing; its commit then stands."""
    st = store(tmp_path)
    rec = write_part(st, 5)
    run_sync(st.io.write(rec.key, [memoryview(rec.to_json())]))
    sid = rec.objects[0].split("/")[1].split(".")[0]
    tx = st.begin_save("5", sid, host=HOST, prepare=False)
    try:
        t = time.time() - 7200  # its objects and record old; its intent fresh, as a beating one is
        for k in [*rec.objects, rec.key]:
            os.utime(tmp_path / k, (t, t))
        run_sync(store(tmp_path).sweep(grace_seconds=0))
        assert not (tmp_path / fence_key("5", rec.fence)).exists()
        assert all(os.path.exists(tmp_path / k) for k in [*rec.objects, rec.key])
        run_sync(st.parts.commit(rec))
        assert run_sync(store(tmp_path).is_committed("5"))
    finally:
        tx.end(ok=True)
