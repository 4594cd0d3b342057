"""Every reader of a checkpoint handles format 2 (issue 14): a checkpoint saved by several hosts
(one root + a fragment per host) through the zarr view, ``ckptio inspect``, ``verify``, ``ls``,
``cp`` and ``convert``, with the same answers they give for the whole checkpoint."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.cli import EXIT_CODES, main
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME, unseal
from ckptio.manifest.formats import HEADS_VERSION
from ckptio.store import CheckpointStore

HOSTS = 4
STEP = 5
#: Uneven row blocks, one per host (their common grid is 2 rows).
ROW_CUTS = [0, 10, 30, 40, 64]
BLOCK = 256  # small checksum blocks: every shard has several


def arrays() -> dict[str, np.ndarray]:
    """The global arrays of the checkpoint (every host holds a part of the sharded ones)."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    return {
        "params/w": w,  # rows, uneven
        "params/w_bf16": (w / 3).astype(ml_dtypes.bfloat16),  # rows, same layout as w
        "opt/mu": rng.standard_normal((64, 48)).astype(np.float32),  # columns
        "emb": rng.integers(-(1 << 30), 1 << 30, size=(6, 8, 5), dtype=np.int32),  # middle dimension
        "params/b": np.arange(48, dtype=np.float64) / 7,  # replicated: host 0 writes it
    }


def _rows(rank: int) -> slice:
    return slice(ROW_CUTS[rank], ROW_CUTS[rank + 1])


def _box(name: str, rank: int) -> tuple[slice, ...]:
    if name in ("params/w", "params/w_bf16"):
        return (_rows(rank), slice(None))
    if name == "opt/mu":
        return (slice(None), slice(rank * 12, (rank + 1) * 12))
    return (slice(None), slice(rank * 2, (rank + 1) * 2), slice(None))


def host_state(rank: int) -> dict[str, Any]:
    full = arrays()

    def sharded(name: str) -> ckptio.Sharded:
        box = _box(name, rank)
        return ckptio.Sharded(full[name].shape, full[name].dtype, [(box, full[name][box])])

    return {
        "params": {"w": sharded("params/w"), "w_bf16": sharded("params/w_bf16"), "b": full["params/b"]},
        "opt": {"mu": sharded("opt/mu")},
        "emb": sharded("emb"),
        "step": STEP,
        "note": "four hosts",
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A format-2 checkpoint of step STEP saved by HOSTS hosts (read-only for the tests below)."""
    root = tmp_path_factory.mktemp("format2") / "run"
    config = ckptio.EngineConfig(block_size=BLOCK)
    on_hosts(HOSTS, lambda rank, coord: ckptio.save(
        str(root), host_state(rank), step=STEP, coordinator=coord, engine_config=config).result())
    doc = json.loads(unseal((root / str(STEP) / MANIFEST_NAME).read_bytes(), "root"))
    assert doc["version"] == HEADS_VERSION and len(doc["fragments"]) == HOSTS  # what every test below relies on
    return root


def run(*argv: str) -> tuple[int, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    out = buf.getvalue()
    return rc, (json.loads(out) if "--json" in argv and out else out)


def whole(root: Path) -> Any:
    """The checkpoint with every fragment loaded: what the tools must agree with."""
    store = CheckpointStore(str(root))
    try:
        return run_sync(store.read_manifest(str(STEP)))
    finally:
        run_sync(store.close())


def assert_restores_bit_exact(root: Path | str, step: int = STEP) -> None:
    got = ckptio.restore(root, step=step)
    for name, want in arrays().items():
        a, _, b = name.partition("/")
        have = got[a][b] if b else got[a]
        assert have.dtype == want.dtype and have.shape == want.shape and have.tobytes() == want.tobytes(), name
    assert got["step"] == STEP and got["note"] == "four hosts"


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


# -- the zarr view ------------------------------------------------------------------------------


def test_zarr_view_reads_a_format2_checkpoint_slice_by_slice_bit_exact(saved: Path) -> None:
    zarr = pytest.importorskip("zarr")
    g = zarr.open_group(store=ckptio.zarr_store(str(saved), step=STEP), mode="r")
    assert sorted(g.group_keys()) == ["opt", "params"]
    assert sorted(g["params"].array_keys()) == ["b", "w", "w_bf16"] and "emb" in list(g.array_keys())
    assert g.attrs["ckptio_values"] == {"step": STEP, "note": "four hosts"}
    full = arrays()
    w = g["params/w"]
    assert w.shape == (64, 48) and w.chunks == (2, 48)  # the common grid of the hosts' uneven rows
    assert w.attrs["ckptio_shards"] == HOSTS
    # Slices within one host's rows, across hosts' boundaries, and whole arrays.
    for sl in [np.s_[11:17], np.s_[5:45, 3:9], np.s_[:, 7], np.s_[63], np.s_[:]]:
        assert np.array_equal(w[sl], full["params/w"][sl]), sl
    mu = g["opt/mu"]
    assert mu.chunks == (64, 12) and mu.attrs["ckptio_shards"] == HOSTS
    assert np.array_equal(mu[3:60, 10:40], full["opt/mu"][3:60, 10:40])
    assert np.array_equal(g["emb"][:, 1:7, 2:], full["emb"][:, 1:7, 2:])
    bf = g["params/w_bf16"]
    assert bf.attrs["ckptio_dtype"] == "bfloat16"
    assert bf[:].view(ml_dtypes.bfloat16).tobytes() == full["params/w_bf16"].tobytes()
    assert g["params/b"][:].tobytes() == full["params/b"].tobytes()


# -- ckptio inspect / verify / ls ----------------------------------------------------------------


def test_inspect_shows_every_hosts_shards_objects_and_checksums(saved: Path) -> None:
    m = whole(saved)
    rc, doc = run("inspect", str(saved), "--json")
    assert rc == 0 and doc["step"] == STEP and doc["hosts"] == HOSTS and doc["block_size"] == BLOCK
    assert doc["objects"] == len(m.objects) >= HOSTS  # every host's objects, not the root's (none)
    full = arrays()
    w = doc["items"]["params/w"]
    assert (w["dtype"], w["shape"], w["origin"]) == ("float32", [64, 48], "sharded")
    assert sorted((s["offsets"], s["shape"], s["host"]) for s in w["shards"]) == [
        ([ROW_CUTS[r], 0], [ROW_CUTS[r + 1] - ROW_CUTS[r], 48], r) for r in range(HOSTS)]
    assert doc["items"]["params/b"]["shards"] == [{"offsets": [0], "shape": [48], "host": 0}]
    assert doc["items"]["step"] == {"value": repr(STEP)}
    assert doc["bytes"] == sum(a.nbytes for a in full.values())
    per_host = {str(r): sum(full[n][_box(n, r)].nbytes for n in full if n != "params/b") for r in range(HOSTS)}
    per_host["0"] += full["params/b"].nbytes
    assert doc["bytes_per_host"] == per_host
    # Every block of every extent in every fragment has its crc32c.
    want_blocks = sum(len(e.crcs) for it in m.items.values() if hasattr(it, "shards") for s in it.shards
                      for e in s.extents)
    assert doc["checksums"]["blocks"] == want_blocks >= sum(-(-n // BLOCK) for n in per_host.values())
    rc, text = run("inspect", str(saved), "--step", str(STEP))
    assert rc == 0 and f"{HOSTS} hosts" in text and f"params/w: float32[64, 48] in {HOSTS} shard(s)" in text


def test_verify_reads_every_hosts_bytes(saved: Path) -> None:
    rc, doc = run("verify", str(saved), "--json")
    assert rc == 0 and doc["ok"], doc
    assert doc["bytes"] == sum(a.nbytes for a in arrays().values())
    assert doc["objects"] == len(whole(saved).objects)


def test_verify_names_a_flipped_byte_in_another_hosts_object(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    m = whole(root)
    shard = next(s for s in m.items["opt/mu"].shards if s.host == 2)
    e = shard.extents[0]
    key = m.objects[e.object]
    assert f".h{2:05d}-" in key  # host 2's own object
    _flip(root / key, e.offset + e.length // 2)
    rc, doc = run("verify", str(root), "--json")
    assert rc == EXIT_CODES["damaged"] and not doc["ok"] and doc["object"] == key and doc["item"] == "opt/mu", doc


def test_verify_and_inspect_name_a_damaged_fragment_and_its_step(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    key = json.loads(unseal((root / str(STEP) / MANIFEST_NAME).read_bytes(), "root"))["fragments"][3]["key"]
    _flip(root / key, (root / key).stat().st_size // 2)
    for cmd in ("verify", "inspect"):
        rc, doc = run(cmd, str(root), "--step", str(STEP), "--json")
        assert rc == EXIT_CODES["damaged"] and not doc["ok"], (cmd, doc)
        assert key in doc["error"] and f"{STEP}/{MANIFEST_NAME}" in doc["error"], (cmd, doc)
    (root / key).unlink()
    rc, doc = run("verify", str(root), "--json")
    assert rc == EXIT_CODES["damaged"] and key in doc["error"] and "missing" in doc["error"], doc


def test_ls_reads_only_roots_and_never_says_zero_objects(saved: Path) -> None:
    # ls reads one root per step (format 2 names the objects in the fragments): it counts the
    # hosts' fragments and leaves the object count unknown rather than calling it 0.
    rc, rows = run("ls", str(saved), "--json")
    assert rc == 0 and len(rows) == 1, rows
    row = rows[0]
    assert (row["step"], row["state"], row["committed"], row["hosts"]) == (STEP, "committed", True, HOSTS)
    assert row["items"] == len(whole(saved).items) and row["bytes"] == sum(a.nbytes for a in arrays().values())
    assert row["objects"] is None and row["fragments"] == HOSTS
    rc, text = run("ls", str(saved))
    assert rc == 0 and f"{HOSTS} host(s)" in text and f"{HOSTS} host fragments" in text and " 0 objects" not in text


# -- ckptio cp ------------------------------------------------------------------------------------


def test_cp_copies_every_hosts_shards_and_restores_bit_exact(saved: Path, tmp_path: Path) -> None:
    dst = tmp_path / "copy"
    rc, doc = run("cp", str(saved), str(dst), "--json")
    assert rc == 0 and doc["ok"] and doc["step"] == STEP, doc
    assert doc["objects"] == len(whole(saved).objects) and doc["written"] == doc["objects"]
    assert_restores_bit_exact(dst)
    rc, ver = run("verify", str(dst), "--json")
    assert rc == 0 and ver["bytes"] == sum(a.nbytes for a in arrays().values())
    # The copy is one whole manifest (format 1), and says which hosts wrote what.
    copied = whole(dst)
    assert sorted({s.host for s in copied.items["params/w"].shards}) == list(range(HOSTS))
    assert copied.checkpoint_id == whole(saved).checkpoint_id
    rc, again = run("cp", str(saved), str(dst), "--json")
    assert rc == 0 and again["already_complete"], again
    # Under another step number too.
    rc, doc = run("cp", str(saved), str(tmp_path / "other"), "--dst-step", "9", "--json")
    assert rc == 0 and doc["step"] == 9
    got = ckptio.restore(tmp_path / "other", step=9)
    assert got["opt"]["mu"].tobytes() == arrays()["opt/mu"].tobytes()
    # Nothing of the source's layout was left behind at the destination that gc would call orphaned.
    store = CheckpointStore(str(dst))
    try:
        report = run_sync(store.sweep(0, dry_run=True))
    finally:
        run_sync(store.close())
    assert report.deleted == [], report


# -- ckptio convert -------------------------------------------------------------------------------


def test_convert_to_dcp_loads_bit_exact_with_stock_dcp(saved: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ckptio.state.leaves import torch_to_numpy

    out = tmp_path / "dcp"
    rc, doc = run("convert", str(saved), str(out), "--from", "ckptio", "--to", "dcp", "--json")
    assert rc == 0 and doc["ok"] and doc["bytes"] == sum(a.nbytes for a in arrays().values()), doc
    full = arrays()
    sd: dict[str, Any] = {
        "params": {"w": torch.zeros(64, 48), "w_bf16": torch.zeros(64, 48, dtype=torch.bfloat16),
                   "b": torch.zeros(48, dtype=torch.float64)},
        "opt": {"mu": torch.zeros(64, 48)},
        "emb": torch.zeros(6, 8, 5, dtype=torch.int32),
        "step": 0, "note": "",
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    for name, want in full.items():
        a, _, b = name.partition("/")
        t = sd[a][b] if b else sd[a]
        assert torch_to_numpy(t.contiguous()).tobytes() == want.tobytes(), name
    assert sd["step"] == STEP and sd["note"] == "four hosts"


def test_convert_to_dcp_and_back_is_the_same_checkpoint(saved: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ckptio.convert import convert

    convert(str(saved), str(tmp_path / "dcp"), src_format="ckptio", dst_format="dcp")
    back = tmp_path / "back"
    convert(str(tmp_path / "dcp"), str(back), src_format="dcp", dst_format="ckptio", step=STEP)
    got = ckptio.restore(back, step=STEP)
    flat = {k: v for k, v in _flatten(got)}
    for name, want in arrays().items():
        have = flat.get(name.replace("/", "."), flat.get(name))  # DCP joins nested names with '.'
        assert np.asarray(have).tobytes() == want.tobytes(), name


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, f"{prefix}{k}" if not prefix else f"{prefix}/{k}")]
    return [(prefix, tree)]


def test_convert_to_orbax_restores_bit_exact_with_stock_orbax(saved: Path, tmp_path: Path) -> None:
    pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    out = tmp_path / "orbax"
    rc, doc = run("convert", str(saved), str(out), "--from", "ckptio", "--to", "orbax", "--json")
    assert rc == 0 and doc["ok"], doc
    got = ocp.StandardCheckpointer().restore(str(out))
    for name, want in arrays().items():
        a, _, b = name.partition("/")
        have = np.asarray(got[a][b] if b else got[a])
        assert have.dtype == want.dtype and have.tobytes() == want.tobytes(), name


# -- on fake-gcs-server -----------------------------------------------------------------------------


@pytest.mark.gcs
def test_every_reader_on_a_format2_checkpoint_in_gcs(gcs_emulator_env: str, tmp_path: Path) -> None:
    """Hashed object names on GCS: the fragments and objects of four hosts, read by every tool."""
    from tests.conftest import GCS_TEST_BUCKET

    url = f"gs://{GCS_TEST_BUCKET}/format2-{tmp_path.name}"
    on_hosts(HOSTS, lambda rank, coord: ckptio.save(url, host_state(rank), step=STEP, coordinator=coord).result())
    rc, rows = run("ls", url, "--json")
    assert rc == 0 and rows[0]["fragments"] == HOSTS and rows[0]["hosts"] == HOSTS, rows
    rc, doc = run("inspect", url, "--json")
    assert rc == 0 and sorted(doc["bytes_per_host"]) == [str(r) for r in range(HOSTS)], doc
    rc, doc = run("verify", url, "--json")
    assert rc == 0 and doc["bytes"] == sum(a.nbytes for a in arrays().values()), doc
    zarr = pytest.importorskip("zarr")
    g = zarr.open_group(store=ckptio.zarr_store(url), mode="r")
    assert np.array_equal(g["opt/mu"][5:50, 7:30], arrays()["opt/mu"][5:50, 7:30])
    rc, doc = run("cp", url, str(tmp_path / "local"), "--json")
    assert rc == 0 and doc["written"] == doc["objects"] >= HOSTS, doc
    assert_restores_bit_exact(tmp_path / "local")
