"""Replication keeps up under load (issue 33): a save begins only once the previous step's replica is
complete, so a host lost while its newest step is still being replicated costs that one step, never more
and never a read of the durable tier. Real processes (torch.distributed, gloo), via
tests/workers/tiers_worker.py."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("torch")

from tests.tiers.test_tiers_mp import run

pytestmark = pytest.mark.slow


def test_a_host_lost_under_load_costs_one_step(tmp_path):
    root = str(tmp_path)
    steps = [1, 2, 3, 4, 5]
    common = ["--keep", "2", "--every", "0"]
    saved = run(3, "keepup", root, "--steps", ",".join(map(str, steps)), "--slow-peer", "0.5", *common)
    for r in saved.values():
        for prev, now in zip(r["seen"], r["seen"][1:]):
            # When save(k) began, every host's k-1 was on its partner; only k itself may be unreplicated.
            assert now["replicated"] == prev["step"], r["seen"]
            assert set(now["uncopied"]) <= {now["step"]}, r["seen"]
        assert r["tiers"]["fast"] == [4, 5] and r["tiers"]["peer"] == [4], r
    # Host 1's node died while step 5 was being replicated: its SSD is gone.
    shutil.rmtree(tmp_path / "fast" / "r1")
    got = run(3, "restore", root, "--expect-step", "4", "--durable", str(tmp_path / "durable"), *common)
    assert got[1]["sources"]["1"] == "peer" and got[1]["bytes_from"]["local"] == 0
    assert all(r["durable_reads"] == 0 for r in got.values()), got
