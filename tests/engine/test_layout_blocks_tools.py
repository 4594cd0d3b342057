"""Per-extent checksum blocks through every writer and tool: format-2 fragments, the sidecar
writer, ``ckptio cp`` / ``verify`` / ``convert`` and DCP over a checkpoint whose objects mix block
sizes, pack tables beside them, and N -> 2N on the fake GCS server."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from tests.engine.test_layout_blocks import COLS, NAMES, ROWS, check_split, full, manifest, rows, save_rows

import ckptio
from ckptio.backends.wrappers import CountingBackend
from ckptio.cli import main as cli
from ckptio.engine import run_sync
from ckptio.engine.layout import extent_block
from ckptio.manifest import BLOCKS_VERSION, MANIFEST_NAME, unseal
from ckptio.store import CheckpointStore

KIB = 1 << 10
CFG = ckptio.EngineConfig(block_size=64 * KIB)  # 4 MiB shards keep it, 0.4-1.6 MB ones get 12-48 KiB blocks


def mixed_state(rank: int, hosts: int) -> dict[str, Any]:
    """Per host: a big shard (64 KiB blocks), a small one (4 KiB blocks), and (host 0) small whole
    arrays that a pack holds (one crc per member)."""
    big = np.arange(hosts * 1024 * 1024, dtype=np.float32).reshape(hosts * 1024, 1024)
    small = full("w")
    nb, ns = big.shape[0] // hosts, small.shape[0] // hosts
    state: dict[str, Any] = {
        "big": ckptio.Sharded(big.shape, big.dtype, [((slice(rank * nb, (rank + 1) * nb), slice(None)),
                                                      big[rank * nb : (rank + 1) * nb])]),
        "small": ckptio.Sharded(small.shape, small.dtype, [((slice(rank * ns, (rank + 1) * ns), slice(None)),
                                                            small[rank * ns : (rank + 1) * ns])]),
        "norms": [np.full(17, i, np.float32) for i in range(5)],
        "step": 7,
    }
    return state


def expected(hosts: int) -> dict[str, np.ndarray]:
    return {"big": np.arange(hosts * 1024 * 1024, dtype=np.float32).reshape(hosts * 1024, 1024),
            "small": full("w")}


def save_mixed(url: str, hosts: int, writer: str | None = None) -> None:
    cfg = ckptio.EngineConfig(block_size=CFG.block_size)
    opts = ckptio.SaveOptions(writer=writer)
    if hosts == 1:
        ckptio.save(url, mixed_state(0, 1), step=1, engine_config=cfg, save_options=opts).result()
        return
    on_hosts(hosts, lambda rank, coord: ckptio.save(url, mixed_state(rank, hosts), step=1, coordinator=coord,
                                                    engine_config=cfg, save_options=opts).result())


def assert_mixed(url: str, hosts: int, step: int = 1) -> None:
    """The manifest holds both block sizes (in one object), and a restore is bit-exact."""
    m = manifest(url, step)
    want = expected(hosts)
    big = {e.block for s in m.items["big"].shards for e in s.extents}
    small = {e.block for s in m.items["small"].shards for e in s.extents}
    shard_bytes = want["small"].nbytes // hosts
    assert big == {m.block_size} and small == {extent_block(shard_bytes, False, m.block_size)} != big
    got = ckptio.restore(url, step=step)
    for name, arr in want.items():
        assert got[name].tobytes() == arr.tobytes()
    assert [n.tolist() for n in got["norms"]] == [[float(i)] * 17 for i in range(5)] and got["step"] == 7


def run(*argv: str) -> tuple[int, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(list(argv))
    return rc, json.loads(buf.getvalue())


def test_a_format2_save_carries_blocks_through_every_fragment(tmp_path: Path) -> None:
    save_mixed(str(tmp_path), 4)
    root = json.loads(unseal((tmp_path / "1" / MANIFEST_NAME).read_bytes(), "root"))
    assert root["version"] >= BLOCKS_VERSION and len(root["fragments"]) == 4
    # Every fragment read back (columnar, fragment version 3) gives the small shards' extents their
    # own blocks and the big ones the manifest's.
    m = run_sync(CheckpointStore(str(tmp_path)).read_manifest("1"))
    assert m.complete and len(m.items["small"].shards) >= 4
    small = [e for s in m.items["small"].shards for e in s.extents]
    big = [e for s in m.items["big"].shards for e in s.extents]
    assert small and all(e.block < m.block_size for e in small)
    assert big and all(e.block == m.block_size for e in big)
    assert_mixed(str(tmp_path), 4)


def test_a_single_host_save_keeps_pack_tables_beside_own_blocks(tmp_path: Path) -> None:
    save_mixed(str(tmp_path), 1)
    doc = json.loads(unseal((tmp_path / "1" / MANIFEST_NAME).read_bytes(), "manifest"))
    assert doc["version"] == BLOCKS_VERSION and doc.get("packs")  # format 5's tables, in a format-6 document
    assert_mixed(str(tmp_path), 1)


def test_the_sidecar_writer_checksums_in_the_planned_blocks(tmp_path: Path) -> None:
    save_mixed(str(tmp_path), 1, writer="sidecar")
    assert_mixed(str(tmp_path), 1)


def test_verify_and_cp_check_each_extent_in_its_own_blocks(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    save_mixed(str(src), 2)
    rc, doc = run("verify", str(src), "--json")
    assert rc == 0 and doc["ok"], doc
    rc, doc = run("cp", str(src), str(dst), "--json")
    assert rc == 0, doc
    assert_mixed(str(dst), 2)
    rc, doc = run("verify", str(dst), "--json")
    assert rc == 0 and doc["ok"], doc
    # A flipped byte in a small block: verify and cp name the object; the copy writes nothing of it.
    m = manifest(str(src))
    e = m.items["small"].shards[0].extents[0]
    key = m.objects[e.object]
    with open(src / key, "r+b") as f:
        f.seek(e.offset + 2 * e.block + 1)
        b = f.read(1)
        f.seek(e.offset + 2 * e.block + 1)
        f.write(bytes([b[0] ^ 1]))
    rc, doc = run("verify", str(src), "--json")
    assert rc != 0 and not doc["ok"] and doc["object"] == key and doc["item"] == "small", doc
    rc, doc = run("cp", str(src), str(tmp_path / "dst2"), "--json")
    assert rc != 0 and key in json.dumps(doc), doc


def test_convert_to_dcp_and_back_and_dcp_loads_a_checkpoint_with_own_blocks(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptio.dcp import Reader

    src = tmp_path / "src"
    save_mixed(str(src), 2)
    out = {"big": torch.zeros(2048, 1024), "small": torch.zeros(ROWS, COLS)}
    dcp.load(out, storage_reader=Reader(src, step=1))
    want = expected(2)
    assert all(out[n].numpy().tobytes() == want[n].tobytes() for n in want)
    rc, doc = run("convert", str(src), str(tmp_path / "dcp"), "--from", "ckptio", "--to", "dcp", "--json")
    assert rc == 0, doc
    rc, doc = run("convert", str(tmp_path / "dcp"), str(tmp_path / "back"), "--from", "dcp", "--to", "ckptio",
                  "--step", "1", "--json")
    assert rc == 0, doc
    got = ckptio.restore(tmp_path / "back", step=1)
    assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    m = manifest(str(tmp_path / "back"))  # the stream writer gives its shards blocks of their own too
    for n in want:
        item = m.items[n]
        for s in item.shards:
            own = extent_block(s.size * 4, s.shape == item.shape, m.block_size)
            assert own and all(e.block == own for e in s.extents)


def test_the_dcp_writer_gives_chunks_blocks_of_their_own(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptio.dcp import Writer

    url = str(tmp_path)
    w = full("w")
    dcp.save({"w": torch.from_numpy(w.copy()), "b": torch.arange(7.0)}, storage_writer=Writer(url, step=1))
    m = manifest(url)
    (e,) = m.items["w"].shards[0].extents
    assert e.block == extent_block(w.nbytes, True, m.block_size) < m.block_size
    half = (slice(0, ROWS // 2), slice(None))
    counting = CountingBackend(ckptio.backends.open_backend(url))
    got = ckptio.restore(url, step=1, backend=counting, target={"w": ckptio.Sharded(w.shape, w.dtype, [(half, None)])})
    assert got["w"].pieces[0][1].tobytes() == w[half].tobytes()
    read = sum(r.length for k, r in counting.reads if "ckptio." not in k)
    assert w[half].nbytes <= read <= 1.1 * w[half].nbytes


@pytest.mark.gcs
def test_n_to_2n_on_the_fake_gcs_server_reads_at_most_1_1x(gcs_emulator_env: str, tmp_path: Path) -> None:
    from tests.conftest import GCS_TEST_BUCKET
    from fake_gcs import unique_prefix

    url = f"gs://{GCS_TEST_BUCKET}/{unique_prefix(tmp_path)}"
    save_rows(url, hosts=4, options=ckptio.SaveOptions(tile_bytes=0))
    assert manifest(url).items[NAMES[0]].shards[0].extents[0].block < manifest(url).block_size
    worst = check_split(url, list(range(0, ROWS + 1, ROWS // 8)), 1.1)  # 4 -> 8 hosts
    assert worst <= 1.1
    got = ckptio.restore(url, step=1, target={"w": ckptio.Sharded((ROWS, COLS), np.float32, [(rows(0, ROWS), None)])})
    assert got["w"].pieces[0][1].tobytes() == full("w").tobytes()
