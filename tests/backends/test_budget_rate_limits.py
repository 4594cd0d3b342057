"""64 simulated hosts save and restore one checkpoint at once behind a rate-limiting proxy in front
of fake-gcs-server (issue 38, part 1): no save fails, no restore says "no checkpoint", every host
gets its rows back. Times are measured by ``ckptio bench --fake-gcs --rate-limit R``, not here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_gcs import FakeGCS, unique_prefix

from ckptio.bench.ratelimit import RateLimitProxy, request_prefix
from ckptio.bench.throttled import run_throttled

HOSTS = 64
LIMIT = 100.0  # requests/s per class: 64 hosts unbudgeted send several times that at the start


@pytest.mark.slow  # 64 hosts behind a rate limit
def test_64_hosts_save_and_restore_at_once_behind_a_rate_limit(
    fake_gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with RateLimitProxy(fake_gcs.url, LIMIT) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        run = run_throttled(f"gs://ckptio-test/{unique_prefix(tmp_path)}", proxy, HOSTS, budget=0.8 * LIMIT)
    print(run.report())
    save, restore = run.phases
    assert save.failures == [] and restore.failures == [], run.report()
    assert restore.no_checkpoint == 0
    assert save.admitted >= 3 * HOSTS and restore.admitted >= 3 * HOSTS, "every host went through the proxy"


@pytest.mark.slow  # a fake GCS, the proxy and 4 host processes, through the bench's command line
def test_host_processes_save_and_restore_behind_a_rate_limit_and_report_every_field(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "rate.json"
    cmd = [sys.executable, "-m", "ckptio.bench", "--fake-gcs", "--rate-limit", "50", "--hosts", "4",
           "--host-processes", "--budget", "1.0", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert (doc["mode"], doc["hosts"], doc["limit"], doc["budget"]) == ("processes", 4, 50.0, 50.0)
    assert doc["hosts_uss_bytes"] > 0
    assert [p["name"] for p in doc["phases"]] == ["save", "restore"]
    for p in doc["phases"]:
        assert p["failures"] == [] and p["no_checkpoint"] == 0, p
        assert p["admitted"] >= 3 * 4, "every host went through the proxy"
        # the least time is the busier class's (reads or writes) count over the limit
        assert p["refused"] >= 0 and p["wall_s"] > 0 and p["admitted"] / 2 <= p["allowed_s"] * 50.0 <= p["admitted"]
        assert p["ratio"] == p["wall_s"] / p["allowed_s"]
    assert "4 hosts (processes)" in proc.stdout and "wrong 'no checkpoint' 0" in proc.stdout


def test_the_proxy_limits_each_prefix_and_class_and_refuses_with_429(fake_gcs: FakeGCS) -> None:
    import urllib.error
    import urllib.request

    assert request_prefix("/storage/v1/b/bk/o/a%2Fb%2Fc?alt=media", 0) == "bk"
    assert request_prefix("/storage/v1/b/bk/o/a%2Fb%2Fc?alt=media", 2) == "bk/a/b"
    assert request_prefix("/upload/storage/v1/b/bk/o?uploadType=media&name=x%2Fy", 1) == "bk/x"
    assert request_prefix("/storage/v1/b/bk/o?prefix=p%2Fq%2F", 1) == "bk/p"
    with RateLimitProxy(fake_gcs.url, 2.0, burst_s=1.0) as proxy:  # two tokens, refilled at 2/s
        statuses = []
        for _ in range(6):
            try:
                with urllib.request.urlopen(f"{proxy.url}/storage/v1/b/ckptio-test/o") as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as e:
                statuses.append(e.code)
    assert statuses.count(200) >= 2 and 429 in statuses and set(statuses) <= {200, 429}, statuses
    assert proxy.refused["read"] == statuses.count(429) and proxy.admitted["read"] == statuses.count(200)


def test_every_page_of_a_listing_and_every_chunk_of_an_upload_takes_a_slot(
    fake_gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The budget counts HTTP requests, as the storage does: a listing of seven objects in pages
    of two is four reads, a 1 MiB upload in 256 KiB chunks is a session start and four chunks.
    Every request the proxy saw took a slot, and no slot went unused."""
    from ckptio.backends.budget import BudgetedBackend, RequestBudget, RequestRate
    from ckptio.backends.gcs import GCSBackend

    with RateLimitProxy(fake_gcs.url, 1e6) as proxy:  # a counter, not a limit
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        gcs = GCSBackend(f"gs://ckptio-test/{unique_prefix(tmp_path)}", list_page_size=2,
                         resumable_threshold=256 << 10, chunk_size=256 << 10)
        budget = RequestBudget(RequestRate(reads_per_s=1e5, writes_per_s=1e5, hosts=1, rank=0))
        b = BudgetedBackend(gcs, budget)

        async def run() -> tuple[int, int, int, int]:
            try:
                for i in range(7):
                    await b.write(f"d/o{i}", [memoryview(b"x")])
                proxy.reset()
                listed = await b.list("d/")
                assert [i.key for i in listed] == [f"d/o{i}" for i in range(7)]
                pages, page_slots = proxy.admitted["read"], budget.taken("read")
                proxy.reset()
                await b.write("big", [memoryview(bytes(1 << 20))])
                return pages, page_slots, proxy.admitted["write"], budget.taken("write") - 7
            finally:
                await gcs.close()

        pages, page_slots, chunks, chunk_slots = asyncio.run(run())
    assert pages == 4 and page_slots == pages, (pages, page_slots)
    assert chunks == 5 and chunk_slots == chunks, (chunks, chunk_slots)
    assert proxy.refused == {}


def test_a_whole_read_of_a_small_object_is_one_request_through_the_stores_wrappers(
    fake_gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A manifest, fence or fragment read (``Backend.read``) is one GET and one slot on GCS, through
    the wrappers a store puts above it (retries, budget, deadlines), not a stat and then a read:
    each is a round of a host's share in a restore's chain. A missing object is still
    FileNotFoundError, and an empty one reads empty."""
    from ckptio.backends.budget import BudgetedBackend, RequestBudget, RequestRate
    from ckptio.backends.deadline import DeadlineBackend, Deadlines
    from ckptio.backends.gcs import GCSBackend
    from ckptio.backends.retrying import RetryingBackend

    with RateLimitProxy(fake_gcs.url, 1e6) as proxy:  # a counter, not a limit
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        gcs = GCSBackend(f"gs://ckptio-test/{unique_prefix(tmp_path)}")
        budget = RequestBudget(RequestRate(reads_per_s=1e5, writes_per_s=1e5, hosts=1, rank=0))
        b = RetryingBackend(BudgetedBackend(DeadlineBackend(gcs, Deadlines()), budget))
        payload = bytes(range(256)) * 40

        async def run() -> tuple[bytes, bytes, int, int]:
            try:
                await b.write("s/small", [memoryview(payload)])
                await b.write("s/empty", [])
                proxy.reset()
                before = budget.taken("read")
                got = await b.read("s/small")
                reads, slots = proxy.admitted["read"], budget.taken("read") - before
                with pytest.raises(FileNotFoundError):
                    await b.read("s/missing")
                return got, await b.read("s/empty"), reads, slots
            finally:
                await gcs.close()

        got, empty, reads, slots = asyncio.run(run())
    assert got == payload and empty == b""
    assert reads == 1 and slots == 1, (reads, slots)
