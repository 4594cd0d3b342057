"""The durable round on format 2 (ckptio.tiers.durableroot): each host copies its own objects and its own
fragment, host 0 commits the root it holds; no host parses another host's shards.

Three hosts as threads save one step to host-local fast tiers and commit it there as the tiered manager
does (host 0 then holds the root and every fragment, each other host its part and record); then they run
the durable round into one durable store: in memory or a local directory, with a flat or a hashed naming.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import TierGroup, on_hosts
from tests.manifest.test_fragments import CountingReads
# the same job: 3 hosts, each a block of rows
from tests.tiers.test_rootcast import HOSTS, STEP, W, _rows, _state

import ckptio
from ckptio.backends.base import Backend
from ckptio.backends.memory import MemoryBackend
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.manifest import MANIFEST_NAME
from ckptio.manifest.codec.split import FragmentLoader
from ckptio.saving.job import start_save
from ckptio.store import CheckpointStore
from ckptio.tiers.durable import durable_round
from ckptio.tiers.fastcommit import commit_everywhere
from ckptio.tiers.policy import RestorePlan, TierPolicy
from ckptio.tiers.replicator import ReplicationError
from ckptio.tiers.restore import HostTiers, _durable_keys, restore_from_tiers


def _fast(tmp_path: Path, rank: int) -> CheckpointStore:
    return CheckpointStore(str(tmp_path / f"r{rank}"), host_local=True)


def _save_in_fast_tiers(tmp_path: Path) -> None:
    def host(rank: int, member: Any) -> None:
        fast = _fast(tmp_path, rank)
        h = start_save(fast, STEP, _state(rank), coordinator=member)
        h.result()
        assert commit_everywhere(TierGroup(member), fast, STEP, h.part, h.part_bases) is None

    on_hosts(HOSTS, host)


@pytest.fixture(params=["mem-flat", "mem-hashed", "dir-flat", "dir-hashed"])
def durable_url(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    kind, naming = request.param.split("-")
    url = f"mem://durable-{naming}-{tmp_path.name}" if kind == "mem" else str(tmp_path / "durable")
    yield url, (HashedNaming() if naming == "hashed" else None)
    if kind == "mem":
        MemoryBackend.forget(url)


def _durable(where: tuple[str, Any], backend: Backend | None = None) -> CheckpointStore:
    url, naming = where
    return CheckpointStore(url, backend=backend) if naming is None else \
        CheckpointStore(url, naming=naming, backend=backend)


def _fragments_read(reads: CountingReads) -> set[str]:
    return {k for k in reads.keys if "ckptio.fragment." in k}


def _round(tmp_path: Path, where: tuple[str, Any]) -> list[BaseException | None]:
    def host(rank: int, member: Any) -> BaseException | None:
        try:
            durable_round(TierGroup(member), _fast(tmp_path, rank), _durable(where), STEP, TierPolicy())
        except ReplicationError as e:
            return e
        return None

    return on_hosts(HOSTS, host)


def test_every_host_copies_its_fragment_and_host_0_commits_a_root(tmp_path: Path, durable_url: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _save_in_fast_tiers(tmp_path)
    fast_root = run_sync(_fast(tmp_path, 0).read_manifest(str(STEP), shards=False))
    fast_whole = run_sync(_fast(tmp_path, 0).read_manifest(str(STEP)))
    # No host loads any fragment in the round (host 0 sends them as stored; a host parses only its own).
    with monkeypatch.context() as mp:
        mp.setattr(FragmentLoader, "add", lambda *a: pytest.fail("a fragment was loaded during the round"))
        assert _round(tmp_path, durable_url) == [None] * HOSTS
    durable = _durable(durable_url)
    root = run_sync(durable.read_manifest(str(STEP), shards=False))
    assert not root.complete and root.checkpoint_id == fast_root.checkpoint_id
    assert [f.key for f in root.fragments or []] == [f.key for f in fast_root.fragments or []]
    assert root.fence and root.fence != fast_root.fence  # the durable commit's own fence
    whole = run_sync(durable.read_manifest(str(STEP)))
    assert len(whole.objects) == len(fast_whole.objects) >= HOSTS
    if durable_url[1] is None:  # flat: the same keys, the fragments as stored
        assert whole.objects == fast_whole.objects and root.fragments == fast_root.fragments
    else:  # hashed: each fragment renamed to the durable keys, spread over hash prefixes
        assert all(k.split("/")[0].startswith("h") and k.split("/")[1] == str(STEP) for k in whole.objects)
        assert len({k.split("/")[0] for k in whole.objects}) > 1
        assert [k.rpartition("/")[2] for k in whole.objects] == [k.rpartition("/")[2] for k in fast_whole.objects]
    out = ckptio.restore(durable_url[0], step=STEP, backend=durable.backend)
    np.testing.assert_array_equal(out["w"], W)
    assert out["lr"] == 0.5
    # Every key of the copy is owned: a sweep takes nothing, a deletion leaves nothing of it.
    assert set(whole.keys()) <= {o.key for o in run_sync(durable.io.list(""))}
    assert not run_sync(durable.sweep(0)).objects
    assert set(whole.keys()) <= {o.key for o in run_sync(durable.io.list(""))}
    run_sync(durable.delete(str(STEP)))
    left = {o.key for o in run_sync(durable.io.list(""))}
    assert not left & set(whole.keys()) and not any("ckptio.fragment." in k or MANIFEST_NAME in k for k in left)


def test_a_fragment_that_is_not_the_roots_fails_every_host_and_commits_nothing(tmp_path: Path,
                                                                             durable_url: Any) -> None:
    _save_in_fast_tiers(tmp_path)
    fast0 = _fast(tmp_path, 0)
    root = run_sync(fast0.read_manifest(str(STEP), shards=False))
    bad = next(f for f in root.fragments or [] if f.host == 2)
    path = tmp_path / "r0" / bad.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    errors = _round(tmp_path, durable_url)
    assert all(isinstance(e, ReplicationError) for e in errors)
    assert len({str(e) for e in errors}) == 1
    assert "host 2" in str(errors[0]) and "does not match the root" in str(errors[0])
    assert run_sync(_durable(durable_url).committed_steps()) == []


def _target(rank: int) -> dict[str, Any]:
    return {"w": ckptio.Sharded(W.shape, W.dtype, [((_rows(rank), slice(None)), None)]), "lr": None}


def test_a_host_restoring_from_the_durable_tier_reads_the_root_and_only_its_own_fragment(
        tmp_path: Path, durable_url: Any) -> None:
    _save_in_fast_tiers(tmp_path)
    assert _round(tmp_path, durable_url) == [None] * HOSTS
    refs = {f.host: f.key for f in run_sync(_durable(durable_url).read_manifest(str(STEP), shards=False)).fragments}

    def host(rank: int, member: Any) -> tuple[Any, set[str]]:
        reads = CountingReads(_durable(durable_url).backend)
        t = HostTiers(TierGroup(member), _fast(tmp_path, rank), _fast(tmp_path, rank), _durable(durable_url, reads))
        report, out = restore_from_tiers(t, STEP, _target(rank), ("durable",), None)
        assert set(report.sources.values()) == {"durable"}
        return out, _fragments_read(reads)

    for rank, (out, fragments) in enumerate(on_hosts(HOSTS, host)):
        np.testing.assert_array_equal(out["w"].pieces[0][1], W[_rows(rank)])
        assert out["lr"] == 0.5 and fragments == {refs[rank]}


def test_durable_keys_of_one_writer_read_only_that_writers_fragment(tmp_path: Path, durable_url: Any) -> None:
    """A host whose writer and its partner are lost reads that writer's objects from the durable tier: it
    learns their durable keys from that writer's fragment alone, never the whole durable manifest."""
    _save_in_fast_tiers(tmp_path)
    assert _round(tmp_path, durable_url) == [None] * HOSTS
    fast0 = _fast(tmp_path, 0)
    root = run_sync(fast0.read_manifest(str(STEP), shards=False))
    two = [f for f, ref in enumerate(root.fragments or []) if ref.host == 2]
    m = run_sync(fast0.load_fragment_numbers(str(STEP), root, two))
    assert m.objects and not m.complete
    reads = CountingReads(_durable(durable_url).backend)
    plan = RestorePlan(STEP, root.checkpoint_id, HOSTS, 0, True, HOSTS)
    got = _durable_keys(_durable(durable_url, reads), plan, m, {k: i for i, k in enumerate(m.objects)}, m.objects)
    whole = run_sync(_durable(durable_url).read_manifest(str(STEP)))
    assert set(got.values()) <= set(whole.objects)
    assert all(there.rpartition("/")[2] == k.rpartition("/")[2] for k, there in got.items())
    assert _fragments_read(reads) == {ref.key for ref in whole.fragments or [] if ref.host == 2}
