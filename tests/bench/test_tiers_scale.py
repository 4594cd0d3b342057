"""``ckptio bench --tiers-scale``: the simulation drives the tiers' own save and restart code, and what a
non-coordinator receives to agree on a restart's plan does not grow with the number of hosts (issue 33)."""

from __future__ import annotations

from ckptio.bench.cli import main
from ckptio.bench.tiers_scale import run_tiers_scale


def test_restart_plan_traffic_per_host_does_not_grow_with_the_job(tmp_path):
    small = run_tiers_scale(8, shards=4, parent=str(tmp_path), restarts=["behind"])
    big = run_tiers_scale(256, shards=4, parent=str(tmp_path), save=False, restarts=["behind"])
    for who in ("lost", "host"):
        got = [r[f"behind_{who}_received"] for r in (small, big)]
        # The same plan, its host numbers a few digits longer (the every-pair plan's all-gather: 32x).
        assert 0 < got[0] <= got[1] < got[0] + 32 and got[1] < 1024, (who, got)
    # The coordinator alone gathers every host's holdings.
    assert big["behind_coordinator_received"] > 10 * small["behind_coordinator_received"]
    # The save part ran the real commit: a manifest, what host 1 received, the total it adds up to.
    assert small["manifest_bytes"] > 0 and small["save_received_per_host"] > 0
    assert small["save_total"] == small["gathered_at_coordinator"] + 7 * small["save_received_per_host"]


def test_the_command_refuses_a_job_of_one(capsys):
    assert main(["--tiers-scale", "1"]) == 2
    assert "at least 2 hosts" in capsys.readouterr().err


def test_what_a_non_coordinator_receives_per_save_does_not_grow_with_the_job(tmp_path):
    """#33 item 1: a non-coordinator receives its own part's record per save, never the manifest: the same
    bytes at 8 and 64 hosts (host and object numbers a few digits longer), a fraction of the manifest."""
    small = run_tiers_scale(8, shards=4, parent=str(tmp_path), restarts=[])
    big = run_tiers_scale(64, shards=4, parent=str(tmp_path), restarts=[])
    got = [r["save_received_per_host"] for r in (small, big)]
    assert 0 < got[0] <= got[1] < got[0] + 64, got
    assert got[1] * 32 < big["manifest_bytes"], (got, big["manifest_bytes"])
    # In total: the coordinator's gather plus one part per other host, O(hosts).
    assert big["save_total"] == big["gathered_at_coordinator"] + 63 * got[1]
    # The durable round (format 2): a host gets its own fragment and the round's verdicts from host 0, and the
    # durable tier's manifest is the root: neither grows with the shards of the job.
    durable = [r["durable_to_host"] for r in (small, big)]
    assert small["durable_format"] == big["durable_format"] == 2
    assert 0 < durable[0] <= durable[1] < durable[0] + 256, durable
    assert big["durable_manifest_bytes"] <= big["manifest_bytes"], big
