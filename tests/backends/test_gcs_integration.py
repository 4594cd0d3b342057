"""ckptio end to end on ``gs://`` against fake-gcs-server: the native API, the manager, the layout.

Everything goes through the public surface (``ckptio.save`` / ``restore`` /
``CheckpointManager``) with plain ``gs://`` URLs; what lands in the bucket is
checked by listing it through the JSON API directly, not through ckptio.
The module's server is fresh (``fake_gcs`` in conftest); the big fault test
starts its own, so the memory it holds is given back when it ends.

Several hosts are simulated in one process: one thread per host, each with
a thread-hosts member (tests/support/hosts.py) as its coordinator (an all-gather over a
barrier, records passed through JSON as a real coordinator would).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tests.conftest import GCS_TEST_BUCKET
from fake_gcs import FakeGCS, FaultProxy, unique_prefix
from hosts import on_hosts

import ckptio
from ckptio.backends.wrappers import CountingBackend
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME
from ckptio.manifest.names import is_fencing
from ckptio.state.dtypes import ML_DTYPES
from ckptio.store import CheckpointStore

pytestmark = pytest.mark.gcs


# -- helpers --------------------------------------------------------------------------------


def _prefix(tmp_path: Path) -> str:
    """A prefix of the module's bucket that no other test uses."""
    return unique_prefix(tmp_path)


def _url(tmp_path: Path) -> str:
    return f"gs://{GCS_TEST_BUCKET}/{_prefix(tmp_path)}"


def _api(endpoint: str, path: str, *, method: str = "GET", data: bytes | None = None) -> bytes:
    headers = {"Content-Type": "application/octet-stream"} if data is not None else {}
    req = urllib.request.Request(endpoint + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return bytes(r.read())


def bucket_keys(endpoint: str, prefix: str, bucket: str = GCS_TEST_BUCKET, *, fencing: bool = False) -> list[str]:
    """Every object under ``prefix/`` in the bucket, relative to it, listed through the JSON API.

    Commit fences and revocations (ckptio.store.fence) are left out unless ``fencing``: these tests count
    data objects and manifests; tests/store/test_fence.py and tests/manage/test_manager.py count the fences.
    """
    names: list[str] = []
    query = {"prefix": prefix + "/"}
    while True:
        doc = json.loads(_api(endpoint, f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"))
        names += [i["name"][len(prefix) + 1 :] for i in doc.get("items", ())]
        if not doc.get("nextPageToken"):
            return sorted(n for n in names if fencing or not is_fencing(n))
        query["pageToken"] = doc["nextPageToken"]


def read_object(endpoint: str, name: str, bucket: str = GCS_TEST_BUCKET) -> bytes:
    return _api(endpoint, f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media")


def replace_object(endpoint: str, name: str, data: bytes, bucket: str = GCS_TEST_BUCKET) -> None:
    """Overwrite an object behind ckptio's back (a media upload: a new generation, same name)."""
    q = urllib.parse.urlencode({"uploadType": "media", "name": name})
    _api(endpoint, f"/upload/storage/v1/b/{bucket}/o?{q}", method="POST", data=data)


def committed_objects(url: str, steps: list[int], **backend_options: Any) -> set[str]:
    """What the manifests of ``steps`` name, plus the manifests themselves."""
    store = CheckpointStore(url, backend_options=backend_options)
    try:
        keys: set[str] = set()
        for s in steps:
            keys.update(run_sync(store.read_manifest(str(s))).objects)
            keys.add(f"{s}/{MANIFEST_NAME}")
        return keys
    finally:
        run_sync(store.close())


def bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def random_array(shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind == "U":  # code points must be valid
        return np.array(["héllo"] * int(np.prod(shape)), dtype).reshape(shape)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


class _CrashBeforeCommit:
    """A single host whose job dies after its objects are written, before the commit."""

    rank, size = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        raise RuntimeError("host lost before the commit")


def crashed_save(url: str, state: Any, step: int, **backend_options: Any) -> None:
    h = ckptio.save(url, state, step=step, coordinator=_CrashBeforeCommit(), backend_options=backend_options)
    with pytest.raises(RuntimeError, match="host lost"):
        h.result()


# -- the native API ---------------------------------------------------------------------------

NUMPY_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128,
    ">i4", ">f8", "M8[ns]", "m8[s]", "S7", "U5", "V6", np.dtype([("a", "<i4"), ("b", "<f8", (2,))]),
]  # fmt: skip


def test_every_dtype_and_value_round_trips_bit_exact(gcs_emulator_env: str, tmp_path: Path) -> None:
    """One checkpoint with an array of every dtype (ml_dtypes included), scalars, empties and values."""
    rng = np.random.default_rng(0)
    dtypes = [np.dtype(d) for d in NUMPY_DTYPES] + [np.dtype(getattr(ml_dtypes, n)) for n in sorted(ML_DTYPES)]
    arrays = {f"d{i:02d}": random_array((7, 5), d, rng) for i, d in enumerate(dtypes)}
    state = {
        "arrays": arrays,
        "scalar0d": random_array((), np.dtype(ml_dtypes.bfloat16), rng),
        "empty": np.zeros((0, 3), np.float32),
        "noncontig": np.arange(48, dtype=np.int16).reshape(6, 8)[::2, 1::3],
        "values": [1, -(2**80), 1.0 / 3, True, "héllo", b"\x00\xff", None],
        "step": 7,
    }
    url = _url(tmp_path)
    manifest = ckptio.save(url, state, step=7).result()
    assert manifest is not None and all(k.split("/")[0].startswith("h") for k in manifest.objects)
    out = ckptio.restore(url)
    for name, arr in arrays.items():
        assert bits_equal(out["arrays"][name], arr), name
    assert bits_equal(np.asarray(out["scalar0d"]), np.asarray(state["scalar0d"]))
    assert out["empty"].shape == (0, 3)
    assert bits_equal(out["noncontig"], np.ascontiguousarray(state["noncontig"]))
    assert out["values"] == state["values"] and out["step"] == 7


def test_reshard_rows_to_columns_and_odd_boxes(gcs_emulator_env: str, tmp_path: Path) -> None:
    """Saved as 4 row blocks by 4 hosts in small objects; restored in other splits by ranged reads."""
    shape = (96, 80)
    full = (np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * 1.5).astype(ml_dtypes.bfloat16)
    url = _url(tmp_path)
    rows = shape[0] // 4

    def save(rank: int, coord: Any) -> Any:
        # Each host's row block as 4 pieces of 6 rows (960 bytes): one small object each.
        starts = range(rank * rows, (rank + 1) * rows, 6)
        mine = [((slice(r, r + 6), slice(None)), full[r : r + 6]) for r in starts]
        state = {"w": ckptio.Sharded(shape, full.dtype, mine), "step": 3}
        return ckptio.save(url, state, step=3, coordinator=coord, backend_options={"object_size": 1024}).result()

    manifest = on_hosts(4, save)[0]
    assert manifest.fragments is not None and len(manifest.fragments) == 4  # format 2: one per host
    assert len(run_sync(CheckpointStore(url).read_manifest("3")).objects) == 16
    cols = [(slice(None), slice(j * 20, (j + 1) * 20)) for j in range(4)]
    odd = [(slice(3, 70), slice(5, 77)), (slice(95, 96), slice(0, 80)), (slice(10, 11), slice(7, 8))]
    for layout in (cols, odd):
        target = {"w": ckptio.Sharded(shape, full.dtype, [(ix, None) for ix in layout])}
        out = ckptio.restore(url, step=3, target=target)
        for ix, data in out["w"].pieces:
            assert bits_equal(data, np.ascontiguousarray(full[ix])), ix
    assert bits_equal(ckptio.restore(url)["w"], full)


def test_gcs_stores_tiles_by_default_and_a_column_block_reads_only_its_tiles(gcs_emulator_env: str, tmp_path: Path) -> None:
    """Object stores declare tiling: 4 hosts' row blocks (format 2) are tiled, and one host's column
    block reads about its own bytes, bit-exact."""
    n = 1024  # 4 MiB of float32: row blocks of 1 MiB are tiled at 256 KiB
    full = np.arange(n * n, dtype=np.float32).reshape(n, n)
    url = _url(tmp_path)
    cfg = ckptio.EngineConfig(block_size=256 << 10)  # 1 MiB tiles, scaled down 4x
    tiles = ckptio.SaveOptions(tile_bytes=256 << 10)
    assert ckptio.backends.open_backend(url).layout_defaults.tile_bytes == 1 << 20

    def save(rank: int, coord: Any) -> Any:
        ix = (slice(rank * n // 4, (rank + 1) * n // 4), slice(None))
        return ckptio.save(url, {"w": ckptio.Sharded(full.shape, full.dtype, [(ix, full[ix])])}, step=1,
                           coordinator=coord, engine_config=cfg, save_options=tiles).result()

    on_hosts(4, save)
    m = run_sync(CheckpointStore(url).read_manifest("1"))
    assert all(s.tile is not None for s in m.items["w"].shards)
    counting = CountingBackend(ckptio.backends.open_backend(url))
    col = (slice(None), slice(n // 4, n // 2))
    out = ckptio.restore(url, step=1, backend=counting, target={"w": ckptio.Sharded(full.shape, full.dtype, [(col, None)])})
    assert bits_equal(out["w"].pieces[0][1], np.ascontiguousarray(full[col]))
    read = sum(r.length for k, r in counting.reads if "ckptio." not in k)
    assert full[col].nbytes <= read <= 1.5 * full[col].nbytes


# -- the manager: retention, orphans, pagination ------------------------------------------------


def test_retention_keeps_exactly_two_checkpoints_objects(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """max_to_keep=2 after 10 saves: the bucket holds exactly what the two newest manifests name."""
    url, opts = _url(tmp_path), {"endpoint": fake_gcs.url, "object_size": 4096}
    with ckptio.CheckpointManager(url, max_to_keep=2, backend_options=opts) as mngr:
        for step in range(1, 11):
            mngr.save(step, {"w": [np.full(1000, step, np.float32) for _ in range(3)], "step": step})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [9, 10]
        assert (mngr.restore(9)["w"][2] == 9).all() and mngr.restore()["step"] == 10
    keys = bucket_keys(fake_gcs.url, _prefix(tmp_path))
    kept = committed_objects(url, [9, 10], **opts)
    assert set(keys) == kept and len(kept) == 2 * (3 + 1)  # 3 objects of 4 KB each, + the manifest
    assert not any(k.endswith(TOMBSTONE_NAME) for k in keys)


def test_orphan_sweep_removes_crashed_saves_and_keeps_committed(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    url, opts = _url(tmp_path), {"endpoint": fake_gcs.url, "object_size": 4096}
    prefix = _prefix(tmp_path)

    def state(v: int) -> dict[str, Any]:
        return {"w": [np.full(1000, v, np.float32) for _ in range(3)]}  # 3 objects of 4000 bytes

    crashed_save(url, state(-2), 2, **opts)  # step 2's first attempt dies before its commit
    with ckptio.CheckpointManager(url, backend_options=opts) as mngr:
        for step in (1, 2):
            mngr.save(step, state(step))
        mngr.wait_until_finished()
    crashed_save(url, state(-3), 3, **opts)  # and step 3 never commits
    committed = committed_objects(url, [1, 2], **opts)
    orphans = set(bucket_keys(fake_gcs.url, prefix)) - committed
    objects = {k for k in orphans if "ckptio.intent." not in k}  # and the two dead saves' intents
    assert len(objects) == 6 and len(orphans) == 8
    assert all(k.split("/")[1] in ("2", "3") for k in objects) and len(orphans - objects) == 2

    mngr = ckptio.CheckpointManager(url, backend_options=opts)
    with pytest.raises(ckptio.CheckpointNotFoundError):
        mngr.restore(3)
    assert mngr.sweep_orphans(grace_seconds=3600) == []  # too young
    assert set(mngr.sweep_orphans(grace_seconds=0, dry_run=True)) == orphans
    assert set(bucket_keys(fake_gcs.url, prefix)) == committed | orphans  # a dry run deletes nothing
    assert set(mngr.sweep_orphans(grace_seconds=0)) == orphans
    assert set(bucket_keys(fake_gcs.url, prefix)) == committed
    assert mngr.all_steps() == [1, 2]
    assert (mngr.restore(2)["w"][0] == 2).all() and (mngr.restore(1)["w"][2] == 1).all()
    mngr.close()


class _ListRecorder(FaultProxy):
    """A proxy that injects nothing and records the query of every object listing."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream, rate=0.0)
        self.listings: list[dict[str, str]] = []

    async def handle(self, request: Any) -> Any:
        if request.method == "GET" and request.raw_path.split("?", 1)[0].endswith("/o"):
            self.listings.append(dict(request.query))
        return await super().handle(request)


def test_manager_path_with_forced_pagination(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """Every listing the manager does (steps, retention, sweep) in pages of 2 objects."""
    url, prefix = _url(tmp_path), _prefix(tmp_path)
    with _ListRecorder(fake_gcs.url) as proxy:
        opts = {"endpoint": proxy.url, "object_size": 4096, "list_page_size": 2}
        crashed_save(url, {"w": [np.zeros(1000, np.float32)] * 3, "step": -4}, 4, **opts)
        with ckptio.CheckpointManager(url, max_to_keep=3, keep_period=2, backend_options=opts) as mngr:
            for step in range(1, 8):
                mngr.save(step, {"w": [np.full(1000, step, np.float32)] * 3, "step": step})
            mngr.wait_until_finished()
            assert mngr.all_steps() == [2, 4, 5, 6, 7] and mngr.latest_step() == 7
            assert mngr.restore()["step"] == 7 and (mngr.restore(2)["w"][1] == 2).all()
            orphans = set(bucket_keys(fake_gcs.url, prefix)) - committed_objects(url, [2, 4, 5, 6, 7], **opts)
            assert len(orphans) == 4  # the crashed step-4 attempt's 3 objects and its (dead) intent
            assert set(mngr.sweep_orphans(grace_seconds=0)) == orphans
        assert set(bucket_keys(fake_gcs.url, prefix)) == committed_objects(url, [2, 4, 5, 6, 7], **opts)
    assert proxy.listings and all(q.get("maxResults") == "2" for q in proxy.listings)
    flat = [q for q in proxy.listings if "delimiter" not in q]
    assert sum("pageToken" in q for q in flat) >= 10  # the sweep walked ~20 objects 2 at a time
    # Listings by directory (the steps): the emulator pages them too, counting objects only.
    assert any("delimiter" in q for q in proxy.listings)


# -- the commit race ------------------------------------------------------------------------------


class _MeetThenCommit:
    """A single host that waits for its rival before committing, so both reach the commit together."""

    rank, size = 0, 1

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def all_gather(self, obj: Any) -> list[Any]:
        self.barrier.wait()
        return [obj]


def test_two_saves_of_one_step_race_exactly_one_commits(gcs_emulator_env: str, tmp_path: Path) -> None:
    url = _url(tmp_path)
    for step in (1, 2, 3):
        barrier = threading.Barrier(2, timeout=60)
        handles = [
            ckptio.save(url, {"w": np.full(1000, 10 * step + i, np.int32)}, step=step,
                        coordinator=_MeetThenCommit(barrier))
            for i in (0, 1)
        ]  # fmt: skip
        outcomes: list[BaseException | None] = []
        for h in handles:
            try:
                h.result(timeout=120)
                outcomes.append(None)
            except BaseException as e:  # noqa: BLE001 - inspected below
                outcomes.append(e)
        winners = [i for i, o in enumerate(outcomes) if o is None]
        assert len(winners) == 1, outcomes
        [loser] = [o for o in outcomes if o is not None]
        assert isinstance(loser, FileExistsError) and f"{url}/{step} is already committed" in str(loser)
        assert [h.state for h in handles].count(ckptio.SaveState.COMMITTED) == 1
        assert (ckptio.restore(url, step=step)["w"] == 10 * step + winners[0]).all()
    # The losers' objects are orphans: the sweep takes them and nothing else.
    mngr = ckptio.CheckpointManager(url)
    assert len(mngr.sweep_orphans(grace_seconds=0)) == 6  # 3 objects and the 3 losers' dead intents
    assert mngr.all_steps() == [1, 2, 3] and (mngr.restore(3)["w"] >= 30).all()
    mngr.close()


# -- the name spread -------------------------------------------------------------------------------


@pytest.mark.slow  # 8 host processes, 1000 objects
def test_name_spread_1000_objects_from_8_hosts(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """A checkpoint of 1000 objects from 8 hosts: >= 16 first components, none over twice its
    fair share; the next step's objects land under the same components."""
    url, prefix = _url(tmp_path), _prefix(tmp_path)
    hosts, per_host, row = 8, 125, 1024
    shape = (hosts * per_host, row)
    full = np.random.default_rng(3).integers(0, 256, size=shape, dtype=np.uint8)
    opts = {"endpoint": fake_gcs.url, "object_size": row}  # one row per object

    def save(step: int) -> Any:
        def host(rank: int, coord: Any) -> Any:
            rows = range(rank * per_host, (rank + 1) * per_host)
            pieces = [((slice(r, r + 1), slice(None)), full[r : r + 1] ^ step) for r in rows]
            state = {"w": ckptio.Sharded(shape, np.uint8, pieces), "step": step}
            return ckptio.save(url, state, step=step, coordinator=coord, backend_options=opts).result()

        return on_hosts(hosts, host)[0]

    spread: dict[int, collections.Counter[str]] = {}
    for step in (100, 101):
        save(step)
        manifest = run_sync(CheckpointStore(url, backend_options=opts).read_manifest(str(step)))  # all fragments
        assert len(manifest.objects) == hosts * per_host
        keys = [k for k in bucket_keys(fake_gcs.url, prefix) if k.split("/")[1] == str(step)]
        assert sorted(keys) == sorted(manifest.objects)
        first = collections.Counter(k.split("/")[0] for k in keys)
        fair = len(keys) / len(first)
        assert len(first) >= 16 and max(first.values()) <= 2 * fair, first.most_common(3)
        assert all(k.split("/")[1] == str(step) for k in keys)  # the hash first, then the step
        spread[step] = first
    assert set(spread[100]) == set(spread[101])  # the next save warms the same ranges again
    # Restored by one process in another split: each of 4 column blocks reads 1000 ranged pieces.
    target = {"w": ckptio.Sharded(shape, np.uint8, [((slice(200, 700), slice(j * 256, (j + 1) * 256)), None)
                                                     for j in range(4)])}
    out = ckptio.restore(url, step=101, target=target, backend_options={"endpoint": fake_gcs.url})
    for ix, data in out["w"].pieces:
        assert bits_equal(data, full[ix] ^ 101), ix
    assert bits_equal(ckptio.restore(url, step=100, backend_options={"endpoint": fake_gcs.url})["w"], full ^ 100)


# -- damaged objects ----------------------------------------------------------------------------------


def _saved_for_damage(fake_gcs: FakeGCS, tmp_path: Path) -> tuple[str, str, bytes]:
    """A checkpoint of one object: (url, the object's key, its bytes)."""
    url = _url(tmp_path)
    state = {"b": np.ones(10), "params": {"w": np.random.default_rng(1).random((256, 256))}}
    # Checksum blocks of 64 KiB (default 4 MiB): a slice away from the damage is verifiable alone.
    cfg = ckptio.EngineConfig(block_size=64 << 10)
    ckptio.save(url, state, step=1, engine_config=cfg, backend_options={"endpoint": fake_gcs.url}).result()
    [key] = [k for k in bucket_keys(fake_gcs.url, _prefix(tmp_path)) if not k.endswith(MANIFEST_NAME)]
    return url, key, read_object(fake_gcs.url, f"{_prefix(tmp_path)}/{key}")


@pytest.mark.parametrize("damage", ["flipped byte", "zeroed tail"])
def test_corrupted_object_is_detected_and_never_restored(fake_gcs: FakeGCS, tmp_path: Path, damage: str) -> None:
    url, key, data = _saved_for_damage(fake_gcs, tmp_path)
    bad = bytearray(data)
    if damage == "flipped byte":
        bad[len(bad) // 2] ^= 0x10  # inside params/w (after b's 80 bytes)
    else:
        bad[-4096:] = bytes(4096)  # same length: only the checksum can tell
    replace_object(fake_gcs.url, f"{_prefix(tmp_path)}/{key}", bytes(bad))
    opts = {"endpoint": fake_gcs.url}
    with pytest.raises(ckptio.IntegrityError) as e:
        ckptio.restore(url, backend_options=opts)
    assert key in str(e.value) and "params/w" in str(e.value)
    assert e.value.key == key and e.value.item == "params/w"
    # The manager's restore, into caller buffers: the same error, no tree comes back.
    with ckptio.CheckpointManager(url, backend_options=opts) as mngr:
        with pytest.raises(ckptio.IntegrityError, match="params/w"):
            mngr.restore(1, target={"b": np.empty(10), "params": {"w": np.empty((256, 256))}})
        # A slice that avoids the damage still restores (block checksums: partial reads are checked).
        part = ckptio.Sharded((256, 256), np.float64, [((slice(0, 2), slice(None)), None)])
        ok = mngr.restore(1, target={"params": {"w": part}})
        assert ok["params"]["w"].pieces[0][1].shape == (2, 256)


def test_truncated_object_is_an_error_naming_it(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    url, key, data = _saved_for_damage(fake_gcs, tmp_path)
    replace_object(fake_gcs.url, f"{_prefix(tmp_path)}/{key}", data[: len(data) // 2])
    # Shorter than the manifest says: refused before anything is allocated or read, naming the object.
    with pytest.raises(ckptio.IntegrityError, match="its extents need") as e:
        ckptio.restore(url, backend_options={"endpoint": fake_gcs.url})
    assert key in str(e.value)


# -- faults ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [pytest.param(48 << 20, id="48MiB"), pytest.param(1 << 30, id="1GiB", marks=pytest.mark.slow)],
)
def test_save_and_restore_through_10_percent_faults(tmp_path: Path, size: int) -> None:
    """429, 503, resets (mid-body on reads, after the upload on writes) and slow answers on 10 % of
    requests: the save commits once and the restore is bit-exact. Its own server: given back after."""
    rng = np.random.default_rng(11)
    dtypes = [np.float32, ml_dtypes.bfloat16, np.int8, ml_dtypes.float8_e4m3fn]
    n = 16
    per = size // n
    state = {
        f"a{i:02d}": np.frombuffer(rng.bytes(per), np.uint8).view(dtypes[i % len(dtypes)]) for i in range(n)
    }
    state["step"] = 1  # type: ignore[assignment]
    bucket = "ckptio-faults"
    url = f"gs://{bucket}/{_prefix(tmp_path)}"
    # Objects of 1/64 of the state (arrays are cut at 1 MiB multiples): ~50-64 writes and as many
    # reads. Seed 5 draws every fault kind within its first 60 requests, and >= 6 % faults over
    # any first N >= 60, so the assertions at the end hold however requests interleave.
    opts = {"object_size": size // 64}
    # A smaller byte budget than the default bounds what the proxy (which buffers bodies) holds.
    cfg = ckptio.EngineConfig(byte_budget=256 << 20, backoff_max=1.0)
    with FakeGCS() as server:
        server.create_bucket(bucket)
        with FaultProxy(server.url, rate=0.10, seed=5, slow_s=0.2) as proxy:
            opts["endpoint"] = proxy.url  # type: ignore[assignment]
            manifest = ckptio.save(url, state, step=1, copy=False, engine_config=cfg, backend_options=opts).result()
            assert manifest is not None
            out = ckptio.restore(url, engine_config=cfg, backend_options=opts)
            for k, v in state.items():
                if isinstance(v, np.ndarray):
                    assert bits_equal(out[k], v), k
            assert out["step"] == 1
        injected, requests = dict(proxy.injected), proxy.requests
        committed = committed_objects(url, [1], endpoint=server.url)
        assert set(bucket_keys(server.url, _prefix(tmp_path), bucket)) == committed
    assert sum(injected.values()) >= 0.05 * requests and set(injected) == {"429", "503", "reset", "slow"}, (
        injected, requests)


def test_uploads_damaged_in_transit_are_sent_again_and_never_committed(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    """A byte flipped in 30 % of request bodies (the emulator checks no checksum): every damaged
    upload is caught by the CRC32C in its reply and uploaded again by the engine, so the save
    commits exactly its own bytes and restores bit-exact; a damaged commit marker is an error."""
    rng = np.random.default_rng(3)
    state = {f"w{i}": np.frombuffer(rng.bytes(3 << 20), np.float32) for i in range(8)}
    url = _url(tmp_path)
    cfg = ckptio.EngineConfig(backoff_max=0.05)
    with FaultProxy(fake_gcs.url, rate=0.3, seed=2, kinds=("corrupt",)) as proxy:
        opts = {"endpoint": proxy.url, "object_size": 2 << 20}
        ckptio.save(url, state, step=1, copy=False, engine_config=cfg, backend_options=opts).result()
        damaged = proxy.injected["corrupt"]
        proxy.rate = 0.0
        out = ckptio.restore(url, engine_config=cfg, backend_options=opts)
    assert damaged >= 3, proxy.injected  # ~13 data objects at 30 %, seed 2
    for k, v in state.items():
        assert bits_equal(out[k], v), k
    # Re-sent objects replaced the damaged ones under the same names: nothing else is left behind.
    assert set(bucket_keys(fake_gcs.url, _prefix(tmp_path))) == committed_objects(url, [1], endpoint=fake_gcs.url)


# -- ckptio bench --backend gs:// ----------------------------------------------------------------------


def _bench(tmp_path: Path, env: dict[str, str], url: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ckptio.bench", "--backend", url, "--size", "4MiB", "--rounds", "1",
           "--cases", "raw-aiohttp*,ckptio", "--json", str(out), "--no-progress", *extra]
    full_env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "CKPTIO_BENCH_GCS_ENDPOINT")}
    proc = subprocess.run(cmd, env={**full_env, **env}, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    cases = {c["case"]: c for c in doc["cases"]}
    assert set(cases) == {"raw-aiohttp", "raw-aiohttp-multipart", "ckptio"}
    for name, c in cases.items():
        assert c["status"] == "ok", (name, c.get("error"), c.get("stderr_tail"))
        assert c["samples"][0]["verified"] and c["samples"][0]["save_s"] > 0
    ratios = doc["ratios"]["ckptio"]["raw-aiohttp"]
    assert ratios["save_gibps"] > 0 and ratios["restore_gibps"] > 0
    assert "ckptio ÷ each case" in proc.stdout and "raw-aiohttp" in proc.stdout
    return doc


def test_bench_starts_its_own_fake_gcs_per_case(tmp_path: Path) -> None:
    doc = _bench(tmp_path, {}, "gs://ckptio-bench/run", "--fake-gcs")  # a plain gs:// URL is a real bucket
    target = doc["config"]["target"]
    assert target["scheme"] == "gs" and "fake-gcs-server" in target["server"]
    assert len(target["server_rss_bytes"]) == 3  # one server per case, stopped after it


def test_bench_against_a_given_emulator_cleans_up(fake_gcs: FakeGCS, tmp_path: Path) -> None:
    doc = _bench(tmp_path, {"STORAGE_EMULATOR_HOST": fake_gcs.url}, "gs://ckptio-bench-given/x")
    assert doc["config"]["target"]["endpoint"] == fake_gcs.url
    assert bucket_keys(fake_gcs.url, "x", bucket="ckptio-bench-given") == []  # each case's objects deleted
