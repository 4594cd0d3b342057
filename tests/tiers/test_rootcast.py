"""The manifest at a tiered restore (ckptio.tiers.rootcast): a format-2 root is broadcast without its
fragments, and each host gets from the sender only the fragments its own target meets, as stored.

Three hosts as threads save one step to host-local stores (host 0 then holds the root and every
fragment, ``tests/saving/test_carried_fragments.py``); then they agree on the step's manifest as a tiered
restore does.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import TierGroup, on_hosts

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import CheckpointNotFoundError
from ckptio.manifest import MANIFEST_NAME
from ckptio.restoring.planner import select
from ckptio.saving.job import start_save
from ckptio.store import CheckpointStore
from ckptio.tiers.peer import RoutedBackend
from ckptio.tiers.policy import Holding, RestorePlan
from ckptio.tiers.rootcast import HostTiers, manifest_for

HOSTS, ROWS, COLS, STEP = 3, 48, 8, 4
W = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)


def _rows(rank: int) -> slice:
    return slice(rank * ROWS // HOSTS, (rank + 1) * ROWS // HOSTS)


def _state(rank: int) -> dict[str, Any]:
    return {"w": ckptio.Sharded(W.shape, W.dtype, [((_rows(rank), slice(None)), W[_rows(rank)])]), "lr": 0.5}


def _target(rank: int) -> dict[str, Any]:
    return {"w": ckptio.Sharded(W.shape, W.dtype, [((_rows(rank), slice(None)), None)]), "lr": None}


def _saved(tmp_path: Path) -> str:
    def host(rank: int, coord: Any) -> None:
        start_save(CheckpointStore(str(tmp_path / f"r{rank}"), host_local=True), STEP, _state(rank),
                   coordinator=coord).result()

    on_hosts(HOSTS, host)
    return run_sync(CheckpointStore(str(tmp_path / "r0"), host_local=True).read_manifest(str(STEP),
                                                                                        shards=False)).checkpoint_id


def _manifests(tmp_path: Path, cid: str) -> list[tuple[Any, RoutedBackend, TierGroup]]:
    plan = RestorePlan(STEP, cid, HOSTS, 0, False, HOSTS, replica_offset=1)

    def host(rank: int, member: Any) -> tuple[Any, RoutedBackend, TierGroup]:
        fast = CheckpointStore(str(tmp_path / f"r{rank}"), host_local=True)
        group = TierGroup(member)
        routed = RoutedBackend(f"tiers://{fast.url}", {})
        return manifest_for(HostTiers(group, fast, fast, None), plan, lambda w: fast, _target(rank), routed), \
            routed, group

    return on_hosts(HOSTS, host)


def test_each_host_gets_the_root_and_only_the_fragments_its_target_meets(tmp_path: Path) -> None:
    cid = _saved(tmp_path)
    lead = CheckpointStore(str(tmp_path / "r0"), host_local=True)
    root = run_sync(lead.read_manifest(str(STEP), shards=False))
    assert root.fragments is not None and not root.complete
    by_host = {ref.host: ref for ref in root.fragments}
    root_size = (tmp_path / "r0" / str(STEP) / MANIFEST_NAME).stat().st_size
    for rank, (m, routed, group) in enumerate(_manifests(tmp_path, cid)):
        assert not m.complete and m.checkpoint_id == cid and m.objects == []  # the root, not every shard
        own = by_host[rank]
        assert set(routed.fragments) == {own.key}, (rank, sorted(routed.fragments))
        if rank:  # the root's bytes plus its own fragment (and its ask's reply framing), never another host's
            assert group.received <= root_size + 1 + own.size, (rank, group.received)
        # What the restore's planning then loads through the routed view: this host's rows, bit-exact.
        view = CheckpointStore(routed.url, backend=routed, host_local=True)
        loaded = run_sync(view.load_fragments(str(STEP), m, lambda: select(m, _target(rank), "").boxes(m)))
        assert [s.host for s in loaded.items["w"].shards] == [rank]
        for key in loaded.objects:  # the objects the plan reads are the host's own, in its own fast tier
            assert (tmp_path / f"r{rank}" / key).exists()


def test_a_fragment_that_does_not_match_the_root_fails_every_host_alike(tmp_path: Path) -> None:
    cid = _saved(tmp_path)
    root = run_sync(CheckpointStore(str(tmp_path / "r0"), host_local=True).read_manifest(str(STEP), shards=False))
    bad = next(ref for ref in root.fragments or [] if ref.host == 2)
    path = tmp_path / "r0" / bad.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    errors: list[str] = []
    plan = RestorePlan(STEP, cid, HOSTS, 0, False, HOSTS, replica_offset=1)

    def host(rank: int, member: Any) -> None:
        fast = CheckpointStore(str(tmp_path / f"r{rank}"), host_local=True)
        routed = RoutedBackend(f"tiers://{fast.url}", {})
        with pytest.raises(CheckpointNotFoundError, match="fragments did not reach every host") as e:
            manifest_for(HostTiers(TierGroup(member), fast, fast, None), plan, lambda w: fast, _target(rank), routed)
        errors.append(str(e.value))

    on_hosts(HOSTS, host)
    assert len(errors) == HOSTS and len(set(errors)) == 1 and "host 2" in errors[0] and bad.key in errors[0]


def test_host_0s_partner_keeps_a_format_2_manifest_as_stored(tmp_path: Path) -> None:
    """The peer round's host 0 sends its root's stored bytes (it parses no fragment) and its fragments after
    its objects; its partner writes the fragments, then commits that root as it is: the replica reads
    back as host 0's whole manifest, and a restart's scan counts it."""
    from ckptio.tiers.peer import holdings
    from ckptio.tiers.peerround import _commit_part_replica, _head, _JobManifest, own_part

    cid = _saved(tmp_path)
    fast = CheckpointStore(str(tmp_path / "r0"), host_local=True)
    root = run_sync(fast.read_manifest(str(STEP), shards=False))
    rec, _m = own_part(fast, STEP, 0)
    head, error = _head(fast, STEP, rec, root)
    assert error is None and head["manifest"] is None and head["root"]
    job = _JobManifest.of(json.loads(json.dumps(head)), "replica")
    assert job is not None and job.data == (tmp_path / "r0" / str(STEP) / MANIFEST_NAME).read_bytes()
    assert [f.key for f in job.fragments] == [f.key for f in root.fragments or []]
    replica = CheckpointStore(str(tmp_path / "peer"), host_local=True)
    for key in [*rec.objects, *(f.key for f in job.fragments)]:  # what the round's messages write
        run_sync(replica.io.write(key, [memoryview((tmp_path / "r0" / key).read_bytes())]))
    run_sync(_commit_part_replica(replica, STEP, rec, job, 0))
    assert (tmp_path / "peer" / str(STEP) / MANIFEST_NAME).read_bytes() == job.data
    whole, kept = (run_sync(s.read_manifest(str(STEP))) for s in (fast, replica))
    assert kept.checkpoint_id == cid and kept.objects == whole.objects and kept.items.keys() == whole.items.keys()
    assert holdings(CheckpointStore(str(tmp_path / "own"), host_local=True), replica, 1) == [
        Holding(1, STEP, cid, 0, HOSTS, False)]
    # A damaged root is refused before anything is committed.
    with pytest.raises(Exception, match="(?i)checksum|crc|seal|manifest"):
        _JobManifest.of({"root": base64.b64encode(job.data[:-3] + b"xyz").decode()}, "replica")


def test_a_provider_answers_only_the_asks_its_plan_gives_it_for_that_writers_own_keys() -> None:
    """A peer fetch asks by key (a provider holds no manifest): the provider answers an ask only if the
    needer's plan fetches that writer from it and the key's name says that writer; else it says why."""
    from ckptio.tiers.peer import _bad_ask, _peer_source

    plan = RestorePlan(STEP, "0123456789ab", HOSTS, 0, False, HOSTS, replica_offset=1, exceptions={1: (2,)})
    needer, writer = 1, 1  # host 1 lost: its own part comes from its partner, host 2
    provider = _peer_source(plan, needer, writer)
    assert provider == 2
    key = f"{STEP}/0123456789ab.h00001-00000"
    assert _bad_ask(plan, provider, needer, writer, key, 10) is None
    assert "does not fetch from host 0" in (_bad_ask(plan, 0, needer, writer, key, 10) or "")
    assert "its name does not say" in (_bad_ask(plan, provider, needer, writer, key.replace("h00001", "h00002"), 10)
                                       or "")
    for ask in ((None, key, 10), (writer, 7, 10), (writer, key, -1), (writer, key, "10")):
        assert "malformed" in (_bad_ask(plan, provider, needer, *ask) or ""), ask
