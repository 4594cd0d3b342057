"""ckptio.dcp with real processes (torch.distributed, gloo): resharding, resume, async_save.

Each test launches tests/workers/dcp_worker.py in N processes; the worker asserts,
this file only checks that every rank exited cleanly (and compares losses).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from paths import WORKERS  # noqa: E402

WORKER = str(WORKERS / "dcp_worker.py")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n: int, *args: str, timeout: float = 300) -> None:
    """Run the worker in ``n`` processes; fail with their output if any fails or hangs (a hang: past
    ``timeout``, which leaves room for a 2-core machine running the suite in parallel beside busy loops)."""
    port = _free_port()
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, WORKER, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for q in procs:
            q.kill()
        outs = [q.communicate()[0] for q in procs]
        pytest.fail("ranks hung:\n" + "\n\n".join(f"rank {i}:\n{o[-3000:]}" for i, o in enumerate(outs)))
    failed = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n\n".join(f"rank {i} exited {rc}:\n{o[-4000:]}" for i, rc, o in failed)


def test_dtensor_shard0_on_4_loads_as_shard1_on_2_and_whole_on_1(tmp_path):
    """Every dtype bit-exact (bf16, f16, f32, float8, int64, bool, uint8, complex), uneven and empty shards."""
    root = str(tmp_path / "ckpt")
    run_ranks(4, "save_dtensor", root)
    run_ranks(2, "load_shard1", root)
    run_ranks(1, "load_full", root)


def test_dtensor_shard0_on_4_loads_as_shard1_on_3_and_2_reading_each_stored_byte_once(tmp_path):
    """The Reader's read_once (logical-box exchange over gloo): every dtype bit-exact, uneven and
    empty shards, a replicated tensor and a byte item, on fewer ranks than saved."""
    root = str(tmp_path / "ckpt")
    run_ranks(4, "save_dtensor", root)
    run_ranks(3, "load_shard1", root, "once")
    run_ranks(2, "load_shard1", root, "once")


def test_deterministic_resume_model_adam_rng_loader(tmp_path):
    root, out = str(tmp_path / "run"), str(tmp_path / "losses")
    os.makedirs(out)
    run_ranks(2, "resume_a", root, out)  # N steps, save, M steps
    run_ranks(2, "resume_b", root, out)  # fresh processes: restore, M steps
    for rank in range(2):
        with open(os.path.join(out, f"a_{rank}.json")) as fa, open(os.path.join(out, f"b_{rank}.json")) as fb:
            a, b = json.load(fa), json.load(fb)
        assert len(a) == len(b) > 0 and a == b, (rank, a, b)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save(tmp_path, executor):
    run_ranks(2, "async", str(tmp_path / "async"), executor)


@pytest.mark.gcs
def test_async_save_and_reshard_through_fake_gcs(gcs_emulator_env):
    """Two ranks, gs:// (fake-gcs-server): async saves of a Shard(0) DTensor, loaded as Shard(1)."""
    run_ranks(2, "async", f"gs://ckptio-test/dcp-mp-{os.getpid()}", "thread")


def test_stock_checkpoint_shard0_on_2_loads_through_reader_as_shard1_and_whole(tmp_path):
    """A FileSystemWriter checkpoint (per-rank .distcp files) resharded through ckptio.dcp.Reader."""
    root = str(tmp_path / "stock")
    run_ranks(2, "save_dtensor", root, "stock")
    assert os.path.exists(os.path.join(root, ".metadata"))
    run_ranks(2, "load_shard1", root)
    run_ranks(1, "load_full", root)


def test_stock_torch_reads_a_checkpoint_ckptio_wrote_on_2_ranks_resharded_and_whole(tmp_path):
    """Issue 36: saved by ckptio.dcp.Writer on 2 ranks, loaded by stock FileSystemReader as Shard(1) on 2
    ranks and whole on 1, and converted by torch's dcp_to_torch_save; every dtype bit-exact."""
    root = str(tmp_path / "ckpt")
    run_ranks(2, "save_dtensor", root)
    assert os.path.exists(os.path.join(root, ".metadata"))
    run_ranks(2, "load_shard1", root, "torch")
    run_ranks(1, "load_full", root, "torch")


def test_a_committed_step_is_one_plain_error_on_every_rank(tmp_path):
    run_ranks(2, "exists", str(tmp_path / "run"))


def test_stock_per_rank_metadata_loads_through_reader(tmp_path):
    """FileSystemWriter without collectives (``__<rank>.metadata``): each rank loads its own through the Reader."""
    run_ranks(2, "stock_per_rank", str(tmp_path / "per-rank"))


@pytest.mark.gcs
def test_stock_checkpoint_on_fake_gcs_loads_through_reader_as_shard1(gcs_emulator_env, tmp_path):
    """The same stock files, where an old run left them on GCS (fake-gcs-server): loaded where they lie."""
    from ckptio.engine import run_sync
    from ckptio.store import CheckpointStore

    local = str(tmp_path / "stock")
    run_ranks(2, "save_dtensor", local, "stock")
    url = f"gs://ckptio-test/dcp-stock-{os.getpid()}"
    store = CheckpointStore(url)
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as f:
            run_sync(store.backend.write(name, [memoryview(f.read())]))
    run_sync(store.close())
    run_ranks(2, "load_shard1", url)
    run_ranks(1, "load_full", url)
