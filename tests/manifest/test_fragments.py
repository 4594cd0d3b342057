"""Format 2 (issue 14): a multi-host save commits a small root and one fragment per host; a restore
reads only the fragments its target meets; tools still see the whole checkpoint; format 1 still reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from paths import FIXTURES

import ckptio
from ckptio.backends.wrappers import WrapperBackend
from ckptio.cli import main as cli
from ckptio.engine import run_sync
from ckptio.engine.layout import HashedNaming
from ckptio.manifest import MANIFEST_NAME, unseal
from ckptio.manifest.formats import HEADS_VERSION
from ckptio.store import CheckpointStore

HOSTS = 4
ROWS, COLS = 64, 48
FIXTURE = FIXTURES / "format1"


def full(name: str) -> np.ndarray:
    seed = sum(map(ord, name))
    return np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)


def rows_of(rank: int) -> slice:
    n = ROWS // HOSTS
    return slice(rank * n, (rank + 1) * n)


def host_state(rank: int) -> dict[str, Any]:
    return {
        "params": {n: ckptio.Sharded((ROWS, COLS), np.float32, [((rows_of(rank), slice(None)), full(n)[rows_of(rank)])])
                   for n in ("w", "mu", "nu")},
        "bias": np.arange(7, dtype=np.int64),  # replicated: host 0 writes it
        "step": 3,
    }


def save_on_hosts(url: str, step: int = 3, naming: Any = None) -> None:
    on_hosts(HOSTS, lambda rank, coord: ckptio.save(url, host_state(rank), step=step, coordinator=coord,
                                                    naming=naming).result())


def root_doc(root: Path, step: int = 3) -> dict[str, Any]:
    return json.loads(unseal((root / str(step) / MANIFEST_NAME).read_bytes(), "root"))


class CountingReads(WrapperBackend):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.keys: list[str] = []

    async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
        self.keys.append(key)
        await super().read_into(key, rng, buffers)


def test_many_hosts_commit_a_root_and_a_fragment_each(tmp_path: Path) -> None:
    save_on_hosts(str(tmp_path))
    doc = root_doc(tmp_path)
    assert doc["version"] == HEADS_VERSION and len(doc["fragments"]) == HOSTS
    assert all("shards" not in it for it in doc["items"].values())
    # w, mu and nu share their layout: one locator for the three
    assert len({doc["items"][f"params/{n}"]["locator"] for n in ("w", "mu", "nu")}) == 1
    got = ckptio.restore(tmp_path)
    for n in ("w", "mu", "nu"):
        assert got["params"][n].tobytes() == full(n).tobytes()
    assert got["bias"].tolist() == list(range(7)) and got["step"] == 3


def test_a_host_restoring_its_own_rows_reads_only_its_fragment(tmp_path: Path) -> None:
    save_on_hosts(str(tmp_path))
    refs = [f["key"] for f in root_doc(tmp_path)["fragments"]]
    backend = CountingReads(ckptio.backends.open_backend(str(tmp_path)))
    target = {"params": {n: ckptio.Sharded((ROWS, COLS), np.float32, [((rows_of(2), slice(None)), None)])
                         for n in ("w", "mu", "nu")}}
    got = ckptio.restore(tmp_path, step=3, target=target, backend=backend)
    fragments_read = {k for k in backend.keys if "ckptio.fragment." in k}
    assert len(fragments_read) == 1 and fragments_read < set(refs)
    assert got["params"]["w"].pieces[0][1].tobytes() == full("w")[rows_of(2)].tobytes()
    # A column block meets every host's rows: every fragment, and still bit-exact.
    backend = CountingReads(ckptio.backends.open_backend(str(tmp_path)))
    cols = {"params": {"w": ckptio.Sharded((ROWS, COLS), np.float32, [((slice(None), slice(0, 16)), None)])}}
    got = ckptio.restore(tmp_path, step=3, target=cols, backend=backend)
    assert {k for k in backend.keys if "ckptio.fragment." in k} == set(refs)
    assert got["params"]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(full("w")[:, :16]).tobytes()


def test_a_damaged_fragment_is_named_with_its_step(tmp_path: Path) -> None:
    save_on_hosts(str(tmp_path))
    key = root_doc(tmp_path)["fragments"][1]["key"]
    path = tmp_path / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ckptio.IntegrityError, match=f"3/{MANIFEST_NAME}.*{key}"):
        ckptio.restore(tmp_path, step=3)
    mine = {"params": {"w": ckptio.Sharded((ROWS, COLS), np.float32, [((rows_of(0), slice(None)), None)])}}
    assert ckptio.restore(tmp_path, step=3, target=mine)["params"]["w"].pieces[0][1].tobytes() == \
        full("w")[rows_of(0)].tobytes()  # what does not need the damaged fragment still restores


@pytest.mark.parametrize("fault", ["flipped", "missing"])
def test_deleting_with_a_damaged_fragment_still_finds_hashed_objects(tmp_path: Path, fault: str) -> None:
    # Hashed names put the data under <h>/<step>/, outside the step directory; the root manifest
    # names none of them. A fragment that cannot be read must not leave them behind.
    for step in (3, 4):
        save_on_hosts(str(tmp_path), step, naming=HashedNaming())
    kept = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "4" in p.parts}
    assert any(p.parts[0].startswith("h") for p in kept)
    path = tmp_path / root_doc(tmp_path)["fragments"][1]["key"]
    if fault == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    run_sync(CheckpointStore(tmp_path).delete("3"))
    left = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert left == kept, sorted(map(str, left - kept))
    assert ckptio.restore(tmp_path, step=4)["params"]["w"].tobytes() == full("w").tobytes()


def test_tools_see_the_whole_format2_checkpoint(tmp_path: Path) -> None:
    save_on_hosts(str(tmp_path / "src"))
    assert cli(["verify", str(tmp_path / "src")]) == 0
    assert cli(["cp", str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    got = ckptio.restore(tmp_path / "dst", step=3)
    assert got["params"]["nu"].tobytes() == full("nu").tobytes()
    store = CheckpointStore(tmp_path / "src")
    report = run_sync(store.sweep(0))
    assert report.objects == [] and report.intents == []  # fragments are kept as the checkpoint's own
    run_sync(store.delete("3"))
    assert not (tmp_path / "src" / "3").exists()


def test_format1_fixture_written_by_the_previous_release_still_reads(tmp_path: Path) -> None:
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    assert json.loads(unseal((root / "3" / MANIFEST_NAME).read_bytes(), "m"))["version"] == 1
    got = ckptio.restore(root)
    assert got["w"].tobytes() == full("w").tobytes() and got["step"] == 3
    assert cli(["verify", str(root)]) == 0


@pytest.mark.slow  # the bench's simulated 4096-host job
def test_bench_scale_simulation_runs_the_real_commit_and_restore_planning(tmp_path: Path) -> None:
    from ckptio.bench.scale import run_scale

    res = run_scale(16, 16, str(tmp_path))
    assert res["received_per_non_coordinator"] == 12
    # A host restoring its own layout reads the root and its own fragment, not everyone's.
    assert res["same_bytes_read"] <= res["root_bytes"] + 2 * res["fragment_bytes_mean"]
    assert res["resharded_bytes_read"] >= res["root_bytes"] + 16 * res["fragment_bytes_mean"] * 0.9
    assert res["same_requests"] > 0 and res["resharded_requests"] > 0
