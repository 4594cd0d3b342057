"""Logical-box exchange across 8 real processes (torch gloo): rows restored as column blocks read
each stored byte once in the whole job, bit-exact, within the memory bound; a flipped stored byte
is an IntegrityError naming the object on every process."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from ckptio.bench.readonce import launch, make_checkpoints, stored_bytes  # noqa: E402

from paths import WORKERS  # noqa: E402
from readonce_worker import flip_a_byte  # noqa: E402

WORKER = str(WORKERS / "readonce_worker.py")
HOSTS = 8


@pytest.mark.slow
def test_rows_to_columns_by_exchange_reads_once_and_a_flipped_byte_fails_every_process(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    make_checkpoints(str(root), HOSTS, "columns", steps=(1, 2))
    key = flip_a_byte(str(root), 2, rows_of=1, hosts=HOSTS)  # in the shard host 1 sends (shard i: host i % 8)
    reports = launch(WORKER, HOSTS, ["exchange_faults", str(root)], tmp_path / "out")
    # Step 1: every process checked its bytes; the job read each stored byte once (+ each
    # process's own manifest read).
    assert sum(r["read"] for r in reports) <= 1.1 * stored_bytes(str(root), "1")
    for rank, r in enumerate(reports):
        # Warm (the second restore of the process: modules imported, gloo's buffers made), what a
        # restore holds: its result + one round in flight (a band of a row shard it read, the
        # column pieces cut from it, what it received) <= 2x what it restores, + 1 MiB of allocator.
        assert r["warm_rss_growth"] <= 2 * r["restored"] + (1 << 20), (rank, r)
    # Step 2: the process that read the flipped byte names the object; every other names host 1 and it.
    assert {r["flipped"][0] for r in reports} == {"IntegrityError"}, [r["flipped"] for r in reports]
    for rank, r in enumerate(reports):
        assert key in r["flipped"][1] and (rank == 1 or "host 1" in r["flipped"][1]), (rank, r["flipped"])


@pytest.mark.slow
def test_checkpoint_manager_default_restore_of_rows_as_columns_reads_each_stored_byte_once(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    make_checkpoints(str(root), HOSTS, "columns")
    reports = launch(WORKER, HOSTS, ["manager_columns", str(root)], tmp_path / "out")
    # Bit-exact in every process (the worker checks); each stored byte read once in the job.
    assert sum(r["read"] for r in reports) <= 1.1 * stored_bytes(str(root), "1")
