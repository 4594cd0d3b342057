"""``ckptio convert``: stock DCP / Orbax checkpoints -> ckptio -> stock loaders, bit-exact, streaming.

* DCP: a checkpoint written by stock ``FileSystemWriter`` from 2 ranks (gloo,
  DTensor Shard(0)/Shard(1)) -> ckptio (read back natively and through
  ``ckptio.dcp.Reader``) -> a DCP directory that stock ``dcp.load`` reads.
* Orbax: stock ``StandardCheckpointer`` on a 4x2 mesh -> ckptio -> stock
  ``StandardCheckpointer().restore`` (no target, and resharded onto 2x4), in an
  8-device subprocess (tests/workers/interop_orbax_worker.py).
* Streaming: the incremental writer's batches and validation; the peak RSS of
  1 GiB conversions (slow; tests/workers/interop_rss.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import interop_data as D  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from disk import disk_free_at_least  # noqa: E402
from interop_run import check, run_dcp_ranks, run_orbax_worker  # noqa: E402
from paths import WORKERS  # noqa: E402

import ckptio  # noqa: E402
from ckptio.cli import main  # noqa: E402
from ckptio.convert import convert  # noqa: E402
from ckptio.convert.dcp import ckptio_to_dcp  # noqa: E402
from ckptio.dcp import Reader  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402
from ckptio.errors import ManifestError, SaveFailedError  # noqa: E402
from ckptio.saving.stream import StreamWriter  # noqa: E402
from ckptio.store import CheckpointStore  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def cli(*argv: str) -> tuple[int, dict[str, Any]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, json.loads(buf.getvalue())


def to_numpy(t: torch.Tensor) -> np.ndarray:
    from ckptio.state.leaves import torch_to_numpy

    return torch_to_numpy(t.contiguous())


def empty_like_dcp() -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for name, (shape, dt, _d) in D.DCP_TENSORS.items():
        tdt = torch.bfloat16 if np.dtype(dt).name == "bfloat16" else torch.from_numpy(np.empty(0, dt)).dtype
        sd[name] = torch.zeros(shape, dtype=tdt)
    sd["meta"] = {"step": 0, "note": ""}
    return sd


def assert_dcp_state(sd: dict[str, Any], what: str) -> None:
    for name, want in D.dcp_arrays().items():
        assert D.same_bits(to_numpy(sd[name]), want), f"{what}: {name}"
    assert sd["meta"] == {"step": 42, "note": "interop"}, what


@pytest.fixture(scope="module")
def stock_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock FileSystemWriter checkpoint written by 2 ranks (DTensors: every tensor in 2 chunks)."""
    path = tmp_path_factory.mktemp("dcp") / "stock"
    run_dcp_ranks(2, f"fs:{path}")
    return path


@pytest.mark.slow  # stock DCP writes its checkpoint in a subprocess
def test_stock_dcp_to_ckptio_to_stock_dcp_load_bit_exact(stock_dcp: Path, tmp_path: Path) -> None:
    ck, back = str(tmp_path / "ckptio"), str(tmp_path / "back")
    rc, res = cli("convert", str(stock_dcp), ck, "--from", "dcp", "--to", "ckptio", "--step", "3", "--json")
    assert rc == 0 and res["ok"] and res["step"] == 3, res
    # A normal ckptio checkpoint: the ranks' chunks are its shards; natively readable.
    m = run_sync(CheckpointStore(ck).read_manifest("3"))
    assert len(m.items["w"].shards) == 2 and len(m.items["emb"].shards) == 2
    assert m.metadata["dcp"]["planner_data"]["meta.step"] == ["meta", "step"]
    native = ckptio.restore(ck, step=3)
    for name, want in D.dcp_arrays().items():
        assert D.same_bits(native[name], want), name
    # ... and a DCP one, through ckptio's StorageReader.
    sd = empty_like_dcp()
    dcp.load(sd, storage_reader=Reader(ck, step=3), no_dist=True)
    assert_dcp_state(sd, "ckptio.dcp.Reader")
    # Back to the FileSystemWriter layout: stock dcp.load, stock reader.
    rc, res = cli("convert", ck, back, "--from", "ckptio", "--to", "dcp", "--step", "3", "--json")
    assert rc == 0 and res["ok"], res
    sd = empty_like_dcp()
    dcp.load(sd, checkpoint_id=back, no_dist=True)
    assert_dcp_state(sd, "stock dcp.load")
    md = dcp.FileSystemReader(back).read_metadata()
    assert len(md.state_dict_metadata["w"].chunks) == 2 and md.planner_data["meta.note"] == ("meta", "note")
    # Never over an existing checkpoint.
    rc, res = cli("convert", ck, back, "--from", "ckptio", "--to", "dcp", "--step", "3", "--json")
    assert rc == 1 and not res["ok"] and res["type"] == "FileExistsError", res


@pytest.mark.slow  # stock DCP writes its checkpoint in a subprocess
@pytest.mark.gcs
def test_stock_dcp_to_ckptio_on_fake_gcs(stock_dcp: Path, gcs_emulator_env: str) -> None:
    from tests.conftest import GCS_TEST_BUCKET

    url = f"gs://{GCS_TEST_BUCKET}/convert-{os.getpid()}"
    rc, res = cli("convert", str(stock_dcp), url, "--from", "dcp", "--to", "ckptio", "--json")
    assert rc == 0 and res["ok"], res
    m = run_sync(CheckpointStore(url).read_manifest(""))
    assert all(k.startswith("h") for k in m.objects)  # hashed names on the object store
    sd = empty_like_dcp()
    dcp.load(sd, storage_reader=Reader(url), no_dist=True)
    assert_dcp_state(sd, "ckptio.dcp.Reader on gs://")


def test_native_ckptio_to_dcp_in_small_blocks(tmp_path: Path) -> None:
    """A native checkpoint gets DCP's flattening (keys joined by '.'); big shards become row blocks."""
    import ml_dtypes

    w = np.arange(40 * 8, dtype=np.float32).reshape(40, 8)
    pieces = [((slice(0, 25),), w[:25]), ((slice(25, 40),), w[25:])]
    state = {
        "params": {
            "w": ckptio.Sharded(w.shape, w.dtype, pieces),
            "b": (np.arange(8) / 3).astype(ml_dtypes.bfloat16),
        },
        "opt": [np.ones(3, np.int64)],
        "step": 9,
        "empty": np.zeros((0, 4), np.float32),
    }
    ckptio.save(str(tmp_path / "n"), state, step=1).result()
    store = CheckpointStore(str(tmp_path / "n"))
    md = ckptio_to_dcp(store, "1", str(tmp_path / "d"), chunk_bytes=8 * 4 * 4)  # 4 rows a block
    assert len(md.state_dict_metadata["params.w"].chunks) == 7 + 4  # 25 rows -> 7 blocks, 15 -> 4
    sd = {
        "params": {"w": torch.zeros(40, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "opt": [torch.zeros(3, dtype=torch.int64)],
        "step": 0,
        "empty": torch.zeros(0, 4),
    }
    dcp.load(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    assert D.same_bits(to_numpy(sd["params"]["w"]), w) and sd["step"] == 9
    assert D.same_bits(to_numpy(sd["params"]["b"]), state["params"]["b"]) and sd["opt"][0].tolist() == [
        1,
        1,
        1,
    ]


@pytest.fixture(scope="module")
def orbax_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("orbax") is None:
        pytest.skip("needs jax and orbax-checkpoint")
    return run_orbax_worker(tmp_path_factory.mktemp("orbax"), "stock_roundtrip")


@pytest.mark.slow  # stock Orbax in a subprocess
def test_stock_orbax_to_ckptio_to_stock_orbax_restore_bit_exact(orbax_results: dict[str, Any]) -> None:
    """4x2 mesh; scalars, numpy leaves and strings too; the ckptio.orbax adapter's checkpoints as well."""
    check(orbax_results, "stock_roundtrip")


def test_convert_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ckptio cp"):
        convert(str(tmp_path), str(tmp_path / "x"), src_format="ckptio", dst_format="ckptio")
    with pytest.raises(ValueError, match="one side"):
        convert(str(tmp_path), str(tmp_path / "x"), src_format="dcp", dst_format="orbax")
    rc, res = cli("convert", str(tmp_path), str(tmp_path / "x"), "--from", "dcp", "--to", "ckptio", "--json")
    assert rc == 3 and "not a DCP checkpoint" in res["error"] and res["kind"] == "not-found"


# -- the incremental writer --------------------------------------------------


def test_stream_writer_batches_objects_and_commits_last(tmp_path: Path) -> None:
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    counting = CountingBackend(open_backend(str(tmp_path)))
    store = CheckpointStore(str(tmp_path), backend=counting)
    w = StreamWriter(store, 5, batch_bytes=1000, inflight_bytes=2000)
    a = np.arange(100 * 10, dtype=np.float32).reshape(100, 10)  # 4000 bytes, in 4 row shards
    w.add_array("a", a.dtype, a.shape)
    for r in range(0, 100, 25):
        w.write_shard("a", (r, 0), a[r : r + 25])
    w.add_value("step", 5)
    # Written as it went (2000 bytes held at most: two of the four 1000-byte batches are done).
    assert counting.calls("write") >= 2
    assert not run_sync(store.is_committed("5"))
    m = w.commit()
    assert len(m.items["a"].shards) == 4 and len(m.objects) >= 4
    got = ckptio.restore(str(tmp_path), step=5)
    assert D.same_bits(got["a"], a) and got["step"] == 5


def test_stream_writer_refuses_holes_and_existing_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    w = StreamWriter(store, 1)
    w.add_array("a", np.float32, (4, 2))
    w.write_shard("a", (0, 0), np.zeros((2, 2), np.float32))
    with pytest.raises((ManifestError, SaveFailedError), match="elements|no shard"):
        w.commit()
    assert not run_sync(store.is_committed("1"))
    with pytest.raises(ValueError, match="does not fit"):
        w.write_shard("a", (0,), np.zeros(2, np.float32))
    ckptio.save(str(tmp_path), {"x": np.ones(2)}, step=2).result()
    with pytest.raises(FileExistsError):
        StreamWriter(store, 2)


# -- memory: streaming conversions ---------------------------------------------


@pytest.mark.slow
def test_conversions_stream_peak_rss_under_half_the_checkpoint(tmp_path: Path) -> None:
    """Every direction converts a 1 GiB checkpoint in a fresh process whose RSS grows by less than half
    the checkpoint over its imports (a conversion that held the state would grow by all of it), and whose
    peak stays under 1 GiB. 1 GiB, not more: two checkpoints exist at once and CI machines may have
    only a few GiB of disk free."""
    disk_free_at_least(tmp_path, 2.5, "two 1 GiB checkpoints at once")
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "interop_rss.py"), str(tmp_path), "--gib", "1"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in report["conversions"]:
        assert row["peak_rss_mib"] - row["baseline_rss_mib"] < 512, row
        assert row["peak_rss_mib"] < 1024, row


def test_a_failed_stream_writer_ends_its_intent_so_the_step_can_be_saved_again(tmp_path: Path) -> None:
    """A commit refused (holes) or an abort marks the intent dead at once: no beat goes on after it, and a
    retry of the same step in the same process is not refused as "a save in flight"."""
    store = CheckpointStore(str(tmp_path))
    for fail in ("commit", "abort"):
        w = StreamWriter(store, 3)
        w.add_array("a", np.float32, (4, 2))
        w.write_shard("a", (0, 0), np.zeros((2, 2), np.float32))
        if fail == "commit":
            with pytest.raises((ManifestError, SaveFailedError)):
                w.commit()
        else:
            w.abort()
        assert w._tx._thread is not None and not w._tx._thread.is_alive()
    w = StreamWriter(store, 3)
    w.add_array("a", np.float32, (4, 2))
    w.write_shard("a", (0, 0), np.ones((4, 2), np.float32))
    w.commit()
    assert D.same_bits(ckptio.restore(str(tmp_path), step=3)["a"], np.ones((4, 2), np.float32))
