"""Read-once restore across 8 real processes (torch gloo): storage bytes read by the whole job,
bit-exactness, peak RSS per process, and failures seen by every process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from ckptio.bench.readonce import COLS, ROWS, launch, make_checkpoints, stored_bytes  # noqa: E402

from paths import WORKERS  # noqa: E402
from readonce_worker import flip_a_byte  # noqa: E402

WORKER = str(WORKERS / "readonce_worker.py")
HOSTS = 8


def run_job(scenario: str, root: Path, out: Path, *flags: str) -> list[dict[str, Any]]:
    return launch(WORKER, HOSTS, [scenario, str(root), *flags], out)




def _flipped_job(scenario: str, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Rows saved in steps 1 and 2, a byte flipped in step 2's rows of host 1 (its key), the
    job's reports."""
    root = tmp_path / "ckpt"
    make_checkpoints(str(root), HOSTS, "columns", steps=(1, 2))
    key = flip_a_byte(str(root), 2, rows_of=1, hosts=HOSTS)
    return key, run_job(scenario, root, tmp_path / "out")


def _check_job(reports: list[dict[str, Any]], stored: int) -> None:
    total = sum(r["read"] for r in reports)
    # Each process reads the manifest itself (small); the data objects once across the job.
    assert total <= 1.1 * stored, (total, stored, [r["read"] for r in reports])
    for rank, r in enumerate(reports):
        # Restored arrays + one round in flight (a 2 MiB row-shard read received, its scratch, an
        # owner's read of it) + a fixed allowance for gloo's and the engine's buffers and threads.
        assert r["rss_growth"] <= 2 * r["restored"] + (12 << 20), (rank, r)


@pytest.mark.slow
def test_torch_exchange_delivers_every_message_whole(tmp_path: Path) -> None:
    assert all(r["ok"] for r in launch(WORKER, 3, ["exchange", str(tmp_path)], tmp_path / "out"))


@pytest.mark.slow
def test_replicated_restore_reads_each_stored_byte_once(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    make_checkpoints(str(checkpoint), HOSTS, "replicated")
    reports = run_job("replicated", checkpoint, tmp_path / "out")
    _check_job(reports, stored_bytes(str(checkpoint)))
    # Without read-once each of the 8 would have read the replicated arrays: >= 8x their bytes.
    assert all(r["restored"] >= 8 << 20 for r in reports)


@pytest.mark.slow
def test_replicated_restore_over_jax_distributed_reads_each_stored_byte_once(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    checkpoint = tmp_path / "ckpt"
    make_checkpoints(str(checkpoint), HOSTS, "replicated")
    reports = run_job("replicated", checkpoint, tmp_path / "out", "jax")
    assert sum(r["read"] for r in reports) <= 1.1 * stored_bytes(str(checkpoint))
    # Process 0 also runs the coordination service, which relays every exchanged byte: not counted.
    for rank, r in enumerate(reports[1:], 1):
        assert r["rss_growth"] <= 2 * r["restored"] + (12 << 20), (rank, r)


@pytest.mark.slow
def test_dcp_load_through_the_reader_reads_each_stored_byte_once(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    make_checkpoints(str(checkpoint), HOSTS, "replicated")
    reports = run_job("dcp", checkpoint, tmp_path / "out")
    # ``emb`` is all but a few KiB of the checkpoint; without read-once each of the 8 reads it.
    assert sum(r["read"] for r in reports) <= 1.1 * stored_bytes(str(checkpoint))


@pytest.mark.slow
def test_dcp_load_of_rows_as_columns_reads_once_and_a_flipped_byte_fails_every_rank(tmp_path: Path) -> None:
    key, reports = _flipped_job("dcp_faults", tmp_path)
    # Step 1 (checked bit-exact by each rank): the data once across the job, not once per rank.
    _check_job(reports, stored_bytes(str(tmp_path / "ckpt")))
    # Step 2: every rank fails, and names the damaged object (DCP gathers every rank's error).
    for rank, r in enumerate(reports):
        assert r["flipped"][0] and "IntegrityError" in r["flipped"][1] and key in r["flipped"][1], (rank, r["flipped"])


@pytest.mark.slow
def test_checkpoint_manager_reads_once_by_default_over_torch_distributed(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    make_checkpoints(str(checkpoint), HOSTS, "replicated")
    reports = run_job("manager", checkpoint, tmp_path / "out")
    assert sum(r["read"] for r in reports) <= 1.1 * stored_bytes(str(checkpoint))


@pytest.mark.slow
def test_rows_to_columns_reads_each_stored_byte_once(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    make_checkpoints(str(checkpoint), 2 * HOSTS, "columns")  # saved on 16, restored on 8
    reports = run_job("columns", checkpoint, tmp_path / "out")
    _check_job(reports, stored_bytes(str(checkpoint)))
    assert all(r["restored"] == (ROWS * COLS * 4) // HOSTS for r in reports)


@pytest.mark.slow
def test_failures_reach_every_process(tmp_path: Path) -> None:
    key, reports = _flipped_job("faults", tmp_path)
    # A flipped byte: every process fails with IntegrityError; the one that uses the byte names
    # the object, the others name the host at fault.
    kinds = {r["flipped"][0] for r in reports}
    assert kinds == {"IntegrityError"}, [r["flipped"] for r in reports]
    assert key in reports[1]["flipped"][1], reports[1]["flipped"]
    for rank, r in enumerate(reports):
        if rank != 1:
            assert "host 1" in r["flipped"][1] and key in r["flipped"][1], (rank, r["flipped"])
    # A missing object: every process fails naming it, as the same kind; step=None fell back to
    # step 1 on every process (the worker checked its bytes).
    assert {r["missing"][0] for r in reports} == {"FileNotFoundError"}, [r["missing"] for r in reports]
