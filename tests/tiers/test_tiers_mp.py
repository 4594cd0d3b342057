"""Multi-tier checkpointing with real processes (torch.distributed, gloo): peer recovery, durable fallback,
the in-memory emergency tier, and a durable copy killed midway.

Each test launches tests/workers/tiers_worker.py in several processes; every worker
checks its restore bit-exact itself and prints one JSON line, which the
tests read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("torch")

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import CheckpointNotFoundError
from ckptio.manage.verify import verify_checkpoint
from ckptio.manifest import MANIFEST_NAME
from ckptio.store import CheckpointStore
from ckptio.tiers.held import own_object_keys, read_held

from paths import WORKERS
from tiers_worker import full_arrays

WORKER = str(WORKERS / "tiers_worker.py")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(world: int, ranks: Sequence[int], *args: str, port: int, env: dict[str, str] | None = None
          ) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in ranks:
        e = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, WORKER, *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def collect(procs: Sequence[subprocess.Popen[str]], timeout: float = 150, ok_codes: Sequence[int] = (0,)
            ) -> list[dict[str, Any]]:
    """Wait for every process; fail with their output unless each exits with one of ``ok_codes``."""
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    failed = [(p.returncode, o) for p, o in zip(procs, outs) if p.returncode not in ok_codes]
    assert not failed, "\n\n".join(f"exit {rc}:\n{o[-4000:]}" for rc, o in failed)
    return [json.loads(line) for o in outs for line in o.splitlines() if line.startswith("{")]


def run(world: int, *args: str, env: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """Run the worker on ``world`` ranks; each rank's JSON report by rank."""
    reports = collect(spawn(world, range(world), *args, port=_free_port(), env=env))
    return {r["rank"]: r for r in reports}


def kill_mid_copy(tmp_path: Any, args: Sequence[str], env: dict[str, str] | None = None,
                  on_poll: Any = lambda: True) -> None:
    """Run ``copykill`` on 2 hosts and SIGKILL both once each is stalled mid-copy of the durable step;
    ``on_poll()`` must hold at every poll meanwhile (e.g. nothing partial is listed)."""
    procs = spawn(2, range(2), "copykill", str(tmp_path), *args, "--stall-after", "1", port=_free_port(), env=env)
    markers = [tmp_path / f"stalled.r{r}" for r in range(2)]
    deadline = time.monotonic() + 120
    try:
        while not all(m.exists() for m in markers):  # both hosts are mid-copy
            assert time.monotonic() < deadline, "the durable copy never started"
            assert all(p.poll() is None for p in procs), "a worker exited before being killed"
            assert on_poll()
            time.sleep(0.05)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.communicate()


def records_say_what_the_manifests_say(fast: Any, world: int, steps: set[int]) -> None:
    """Each host's commit record of each step it holds, and each replica marker, name the checkpoint and
    the host count host 0's manifest does (what a restart's scan reads instead of the manifest). Only host
    0's fast tier holds the manifest; every other host's part stands by its record alone, under a fence of
    its own, and lists exactly the objects the manifest says that host wrote (#33 item 1)."""
    lead = CheckpointStore(str(fast / "r0"), host_local=True)
    for r in range(world):
        own = CheckpointStore(str(fast / f"r{r}"), host_local=True)
        for s in steps:
            m = run_sync(lead.read_manifest(str(s)))
            assert (fast / f"r{r}" / str(s) / MANIFEST_NAME).exists() == (r == 0), (r, s)
            records = [n for n in os.listdir(fast / f"r{r}" / str(s)) if n.startswith("ckptio.held.")]
            assert records == [f"ckptio.held.{m.checkpoint_id}.h{r:05d}"], (r, s, records)
            doc = json.loads((fast / f"r{r}" / str(s) / records[0]).read_text())
            assert (doc["checkpoint_id"], doc["num_hosts"], doc["host"]) == (m.checkpoint_id, world, r)
            assert doc["objects"] == [m.objects[i] for i in doc["indices"]], (r, s)
            assert doc["objects"] == own_object_keys(m, r), (r, s)
            # It names this host's own commit's fence (a non-coordinator's is not host 0's): trusted.
            assert (doc["fence"] == m.fence) == (r == 0) and run_sync(read_held(own, s, r)) is not None, (r, s)
            assert s in run_sync(own.committed_steps()), (r, s)
        marks = list((fast / f"r{r}" / "peer").glob("*/ckptio.replica-of.h*"))
        assert marks, r
        replica = CheckpointStore(str(fast / f"r{r}" / "peer"), host_local=True)
        for mark in marks:
            # The replica of the source's part: its record (host 0's partner: the job's manifest too).
            source = int(mark.name.rsplit(".h", 1)[1])
            (part,) = [p for p in run_sync(replica.parts.standing(mark.parent.name)) if p.host == source] or [None]
            m = run_sync(lead.read_manifest(mark.parent.name))
            assert (source == 0) == (mark.parent / "ckptio.manifest.json").exists(), (r, source)
            if part is not None:  # host 0's replica committed by the manifest: no record of its own there
                assert part.checkpoint_id == m.checkpoint_id and part.sizes is not None, (r, source)
            else:
                assert source == 0
            assert json.loads(mark.read_text()) == {"checkpoint_id": m.checkpoint_id, "num_hosts": world}


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def durable(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, str]]:
    """The durable tier: a local directory, or a bucket prefix on fake-gcs-server."""
    if request.param == "local":
        return str(tmp_path / "durable"), {}
    server = request.getfixturevalue("fake_gcs")
    from tests.conftest import GCS_TEST_BUCKET

    return f"gs://{GCS_TEST_BUCKET}/tiers{str(tmp_path).replace('/', '-')}", {"STORAGE_EMULATOR_HOST": server.url}


def test_lost_host_restores_from_its_partner_then_from_the_durable_tier(tmp_path, durable):
    durable_url, env = durable
    root = str(tmp_path)
    common = ["--durable", durable_url, "--every", "2", "--keep", "2"]
    saved = run(4, "save", root, "--steps", "1,2,3,4,5", *common, env=env)
    assert all(r["tiers"]["fast"] == [4, 5] and r["tiers"]["peer"] == [5] for r in saved.values()), saved
    assert saved[0]["tiers"]["durable"] == [2, 4]
    records_say_what_the_manifests_say(tmp_path / "fast", 4, {4, 5})

    # Host 2's node is replaced: its SSD (its checkpoints and the replica it kept for host 1) is gone.
    shutil.rmtree(tmp_path / "fast" / "r2")
    got = run(4, "restore", root, "--expect-step", "5", *common, env=env)
    assert got[2]["sources"]["2"] == "peer"  # its own shards came from host 3's replica
    assert all(r["durable_reads"] == 0 for r in got.values()), got  # not one read of the durable tier
    assert got[2]["bytes_from"]["peer"] > 0 and got[2]["bytes_from"]["local"] == 0

    # Its partner (host 3, which kept host 2's replica) is lost too: step 5 is nowhere whole;
    # step 4 is in the durable tier, and hosts 2 and 3 read their shards from there.
    shutil.rmtree(tmp_path / "fast" / "r2", ignore_errors=True)
    shutil.rmtree(tmp_path / "fast" / "r3")
    got = run(4, "restore", root, "--expect-step", "4", *common, env=env)
    assert got[2]["sources"]["2"] == "durable" and got[3]["sources"]["3"] == "durable"
    assert got[2]["durable_reads"] > 0 and got[3]["durable_reads"] > 0
    assert got[0]["durable_reads"] == 0 and got[1]["durable_reads"] == 0  # hosts that kept step 4 read it locally


def test_host_0_and_its_partner_lost_restore_with_the_durable_tiers_manifest(tmp_path):
    """Host 0 and host 1 (which kept host 0's replica) are lost: no fast tier holds host 0's part, where the
    job's manifest is, and the other hosts' fast tiers hold only their own parts (#33 item 1). The newest
    step in the durable tier is restored: its manifest comes from there, under the fast tiers' keys, so
    the surviving hosts still read their own shards locally."""
    root = str(tmp_path)
    common = ["--every", "2", "--keep", "2"]
    saved = run(4, "save", root, "--steps", "1,2,3,4,5", *common)
    assert saved[0]["tiers"]["durable"] == [2, 4] and saved[2]["tiers"]["fast"] == [4, 5], saved
    for r in (0, 1):
        shutil.rmtree(tmp_path / "fast" / f"r{r}")
    got = run(4, "restore", root, "--expect-step", "4", *common)
    assert got[0]["sources"]["0"] == "durable" and got[1]["sources"]["1"] == "durable", got
    assert got[2]["sources"]["2"] == "local" and got[3]["sources"]["3"] == "local", got
    assert got[2]["bytes_from"].get("local", 0) > 0 and got[3]["bytes_from"].get("local", 0) > 0, got


def test_restore_never_reads_a_non_coordinators_manifest(tmp_path):
    """A restore takes the job's manifest from host 0's part only: host 0's own copy, else its partner's
    replica of it. Every other host's fast tier holds no manifest at all (its part stands by its record,
    #33 item 1); a lookalike manifest file put there (damaged beyond reading) is never read, even with
    host 0 lost."""
    root = str(tmp_path)
    common = ["--every", "0", "--keep", "2"]
    saved = run(4, "save", root, "--steps", "4,5", *common)
    assert all(r["tiers"]["fast"] == [4, 5] and r["tiers"]["peer"] == [5] for r in saved.values()), saved
    for r in (1, 2, 3):
        assert not (tmp_path / "fast" / f"r{r}" / "5" / MANIFEST_NAME).exists()
        (tmp_path / "fast" / f"r{r}" / "5" / MANIFEST_NAME).write_bytes(b"{damaged")
    got = run(4, "restore", root, "--expect-step", "5", *common)
    assert all(r["sources"][str(k)] == "local" for k, r in got.items()), got
    # Host 0's node is replaced: the manifest comes from host 1's replica of host 0 (partner = rank + 1).
    shutil.rmtree(tmp_path / "fast" / "r0")
    got = run(4, "restore", root, "--expect-step", "5", *common)
    assert got[0]["sources"]["0"] == "peer" and got[2]["sources"]["0"] == "peer", got
    assert all(r["durable_reads"] == 0 for r in got.values()), got


@pytest.mark.parametrize("victims", [[1], [1, 2]], ids=["host", "host+partner"])
def test_in_memory_tier_recovers_a_lost_host_from_its_partner(tmp_path, victims):
    """Host RAM as the fast tier: host 1 dies (and with it host 2, which kept host 1's replica); the
    others keep their RAM and re-form the job with the replacements. Alone, host 1 gets its shards
    from host 2's RAM in seconds; with host 2 gone too, the job falls back to the durable tier."""
    root = str(tmp_path)
    env = {"PORT2": str(_free_port())}
    args = ["--steps", "1,2,3", "--every", "2", "--keep", "1", "--victims", ",".join(map(str, victims))]
    procs = spawn(4, range(4), "emergency", root, *args, port=_free_port(), env=env)
    for v in victims:
        assert procs[v].wait(timeout=150) == -signal.SIGKILL, procs[v].communicate()[0][-3000:]
    replacements = spawn(4, victims, "replacement", root, *args, port=int(env["PORT2"]), env=env)
    survivors = [p for r, p in enumerate(procs) if r not in victims]
    got = {r["rank"]: r for r in collect([*survivors, *replacements])}
    assert sorted(got) == [0, 1, 2, 3] and not got[1]["survivor"]
    if victims == [1]:
        assert all(r["step"] == 3 and r["durable_reads"] == 0 for r in got.values()), got
        assert got[1]["sources"]["1"] == "peer" and got[1]["bytes_from"]["local"] == 0
        assert got[1]["seconds"] < 10, got[1]
    else:  # step 3 is nowhere whole; step 2 is in the durable tier (RAM keeps only the newest step)
        assert all(r["step"] == 2 and r["durable_reads"] > 0 for r in got.values()), got
        assert all(r["sources"] == {str(w): "durable" for w in range(4)} for r in got.values()), got


def test_durable_copy_killed_midway_is_never_visible_and_the_next_run_completes_it(tmp_path):
    root = str(tmp_path)
    durable = str(tmp_path / "durable")
    store = CheckpointStore(durable)
    args = ["--steps", "1,2", "--every", "2", "--arrays", "3", "--object-size", str(16 << 10)]
    kill_mid_copy(tmp_path, args, on_poll=lambda: run_sync(store.committed_steps()) == [])
    assert run_sync(store.committed_steps()) == []
    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        ckptio.restore(durable, step=2)
    copied_before = [k for k in os.listdir(tmp_path / "durable" / "2")]
    assert copied_before, "some objects should have arrived before the kill"

    got = run(2, "copyresume", root, *args)
    assert got[0]["copied"] == [2] and got[0]["tiers"]["durable"] == [2]
    objects, nbytes = run_sync(verify_checkpoint(store, "2"))
    assert objects >= 6 and nbytes > 0
    out = ckptio.restore(durable, step=2)
    for name, want in full_arrays(2, 2, 3).items():
        assert out[name].tobytes() == want.tobytes(), name
    run_sync(store.close())
