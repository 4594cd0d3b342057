"""The request budget (ckptio.backends.budget) and throttling: shares, ramp, slow-down, patience,
and a throttled listing that is never read as "no checkpoint" (issue 38, part 1)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ckptio
from ckptio.backends import ThrottledError, open_backend
from ckptio.backends.budget import BudgetedBackend, RequestBudget, RequestRate, budgeted
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.retrying import RetryPolicy, retry_call
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import Engine, EngineConfig
from ckptio.errors import CheckpointNotFoundError


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def slots(budget: RequestBudget, kind: str, n: int, clock: Clock) -> list[float]:
    """The start times of ``n`` slots reserved at once (no time passes)."""
    return [clock.now + budget.reserve(kind) for _ in range(n)]


@settings(max_examples=40, deadline=None)
@given(hosts=st.integers(1, 96), rate=st.floats(1.0, 5000.0), start=st.floats(0.0, 1e6))
def test_the_hosts_first_slots_interleave_at_the_job_rate(hosts: int, rate: float, start: float) -> None:
    """Each host's slots come from its rank and the job's size alone, yet when every host of a
    restarting job asks at once, their slots are spaced 1/rate apart: no two hosts fire together,
    and no central server is asked."""
    clock = Clock(start)
    budgets = [RequestBudget(RequestRate(reads_per_s=rate, hosts=hosts, rank=r), clock=clock) for r in range(hosts)]
    times = sorted(slots(b, "read", 1, clock)[0] for b in budgets)
    gaps = np.diff(np.asarray(times))
    assert gaps.size == 0 or gaps.min() >= (1 / rate) * (1 - 1e-6) - 1e-9 * abs(start), (gaps.min(), 1 / rate)


@settings(max_examples=40, deadline=None)
@given(hosts=st.integers(2, 96), rate=st.floats(1.0, 5000.0), start=st.floats(1.6e9, 2.0e9),
       apart=st.floats(0.0, 2.0), later=st.floats(0.0, 3600.0))
def test_hosts_that_began_apart_interleave_on_the_wall_clock(hosts: int, rate: float, start: float, apart: float,
                                                             later: float) -> None:
    """A job's hosts make their budgets up to a couple of seconds apart, on the wall clock (about
    1.7e9 s), and each ramps from its own start. Their slots must still interleave. A grid counted
    from time 0 moved by the share's difference times 1.7e9 s -- seconds, for a difference of a
    part in 10^9 -- and put hosts' slots on top of each other: at the limit, a 429 for one of them
    every round. A smooth ramp made the shares of hosts begun 2 s apart differ by a part in 10^3,
    and their slots drift apart by up to ``hosts * ramp / 1000`` job slots within a round; the
    ramp goes in steps, so they share one share but in the seconds after each step."""
    clock = Clock(start)
    budgets = []
    for r in range(hosts):
        clock.now = start + apart * r / hosts
        budgets.append(RequestBudget(RequestRate(reads_per_s=rate, hosts=hosts, rank=r), clock=clock))
    clock.now = start + apart + later
    # not in the ``apart`` seconds after a step of the ramp, when its hosts straddle it
    assume(math.floor((later + apart) / 1200 * 8) == math.floor(later / 1200 * 8))
    times = sorted(slots(b, "read", 1, clock)[0] for b in budgets)
    gaps = np.diff(np.asarray(times))
    job_rate = budgets[0].share("read") * hosts
    assert gaps.min() >= (1 / job_rate) * (1 - 1e-6) - 4e-16 * start, (gaps.min(), 1 / job_rate)  # float times


@settings(max_examples=30, deadline=None)
@given(hosts=st.integers(1, 64), rate=st.floats(1.0, 5000.0), requests=st.integers(1, 300),
       latency=st.floats(0.0, 0.5))
def test_a_held_back_host_grows_to_at_most_the_job_rate(hosts: int, rate: float, requests: int,
                                                       latency: float) -> None:
    """A host that has more to send than its share (others idle) grows its rate while it is held
    back, up to the whole job's rate and never past it."""
    clock = Clock()
    b = RequestBudget(RequestRate(reads_per_s=rate, ramp_period_s=1e12, hosts=hosts, rank=hosts - 1), clock=clock)
    times = []
    for _ in range(requests):  # one request at a time, the next asked ``latency`` after the last started
        times.append(clock.now + b.reserve("read"))
        clock.now = times[-1] + latency * (1 / rate)
    gaps = np.diff(np.asarray(times))
    assert gaps.size == 0 or gaps.min() >= (1 / rate) * (1 - 1e-6)
    assert b.host_rate("read") <= b.share("read") * hosts * (1 + 1e-9), "never past the job's (barely ramped) rate"
    if requests > 40 and hosts > 1:
        assert b.host_rate("read") > rate / hosts, "held back, it grew past its share"


@settings(max_examples=30, deadline=None)
@given(hosts=st.integers(2, 96), rate=st.floats(1.0, 5000.0), chain=st.integers(1, 10),
       latency=st.floats(0.0, 0.9))
def test_every_host_in_a_short_chain_at_once_keeps_to_its_share(hosts: int, rate: float, chain: int,
                                                                latency: float) -> None:
    """A save or a restore is every host's chain of a few dependent requests at once (each asked as
    the one before it returns). None of them may grow past its share: the job would send above its
    rate, and the storage answer with 429s that cost each a whole round. So every pair of the job's
    slots stays 1/rate apart, however the chains interleave."""
    clock = Clock()
    budgets = [RequestBudget(RequestRate(reads_per_s=rate, ramp_period_s=1e12, hosts=hosts, rank=r), clock=clock)
               for r in range(hosts)]
    asks = [(clock.now, r) for r in range(hosts)]  # (when host r asks its next request, r)
    times: list[float] = []
    for _ in range(chain):
        nxt = []
        for when, r in sorted(asks):
            clock.now = max(clock.now, when)
            times.append(clock.now + budgets[r].reserve("read"))
            nxt.append((times[-1] + latency * hosts / rate, r))  # returns within its own round
        asks = nxt
    gaps = np.diff(np.sort(np.asarray(times)))
    assert gaps.size == 0 or gaps.min() >= (1 / rate) * (1 - 1e-6), (gaps.min(), 1 / rate)
    assert all(b.host_rate("read") == pytest.approx(rate / hosts) for b in budgets)


def test_a_host_gets_its_share_and_ramps_up_to_the_limit() -> None:
    clock = Clock()
    rate = RequestRate(reads_per_s=1000, writes_per_s=100, ramp_period_s=60, ramp_limit=4, hosts=10, rank=3)
    b = RequestBudget(rate, clock=clock)
    assert b.host_rate("read") == pytest.approx(100) and b.host_rate("write") == pytest.approx(10)
    clock.now += 60
    assert b.host_rate("read") == pytest.approx(200)
    clock.now += 600
    assert b.host_rate("read") == pytest.approx(400), "the ramp stops at ramp_limit"


def test_a_throttle_halves_the_rate_once_per_burst_and_it_recovers() -> None:
    clock = Clock()
    b = RequestBudget(RequestRate(writes_per_s=64, recover_s=10, hosts=4, rank=0), clock=clock)
    assert b.host_rate("write") == pytest.approx(16)
    for _ in range(20):  # a lone burst at its share: requests bunched, not a storage below the job's rate
        b.throttled("write")
    assert b.host_rate("write") == pytest.approx(16) and b.slowdowns == 0 and b.throttles == 20
    clock.now += 1  # throttled again soon after: the storage allows less; twenty in flight, one halving
    for _ in range(20):
        b.throttled("write")
    assert b.host_rate("write") == pytest.approx(8, rel=0.01) and b.slowdowns == 1 and b.throttles == 40
    clock.now += 1  # a new burst: halved again
    b.throttled("write")
    assert b.slowdowns == 2 and b.host_rate("write") < 8
    assert b.host_rate("read") == pytest.approx(5000 / 4, rel=0.01), "reads keep their own rate (ramped a little)"
    clock.now += 100
    b.reserve("write")  # the next request, idle ~100 s after the throttle: recover_s doublings since
    assert b.host_rate("write") == pytest.approx(b.share("write")), "back to its share"
    assert b.share("write") == pytest.approx(16 * 2 ** (math.floor(102 / 1200 * 8) / 8)), "ramped in eighths"


def test_a_host_above_its_share_drops_back_to_it_when_throttled() -> None:
    """Growth past the share is borrowed from idle hosts; a throttle returns it at once, whole,
    and takes nothing of the share itself."""
    clock = Clock()
    b = RequestBudget(RequestRate(reads_per_s=64, ramp_period_s=1e12, hosts=8, rank=2), clock=clock)
    for _ in range(400):  # a queue that keeps it held back (longer than a save's chain): it grows
        clock.now += 0.01
        b.reserve("read")
    assert b.host_rate("read") > 8 * 1.5
    b.throttled("read")
    assert b.host_rate("read") == pytest.approx(8) and b.slowdowns == 1


def test_rank_and_size_come_from_the_coordinator_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RequestRate().resolved() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    assert RequestRate().resolved() == (5, 8)
    assert RequestRate().for_host(2, 4).resolved() == (2, 4)
    assert RequestRate(hosts=3, rank=1).for_host(2, 4).resolved() == (1, 3), "a rate that names its host keeps it"
    cfg = EngineConfig(request_rate=RequestRate()).for_host(1, 2)
    assert cfg.request_rate is not None and cfg.request_rate.resolved() == (1, 2)
    with pytest.raises(ValueError, match="reads_per_s"):
        RequestRate(reads_per_s=0)


def test_the_engine_and_the_store_share_one_budget_per_storage() -> None:
    rate = RequestRate(hosts=2, rank=1)
    backend = MemoryBackend()
    engine = Engine(backend, EngineConfig(request_rate=rate))
    again = budgeted(backend, rate)
    assert isinstance(engine.backend, BudgetedBackend) and isinstance(again, BudgetedBackend)
    assert engine.backend.budget is again.budget
    assert not isinstance(Engine(backend).backend, BudgetedBackend), "no budget unless asked for"
    assert Engine(backend, EngineConfig(deadlines=None)).backend is backend


class Throttling(WrapperBackend):
    """Answers the first ``times`` calls of ``methods`` (every one: -1) with ThrottledError."""

    def __init__(self, inner: Any, methods: tuple[str, ...], times: int = -1) -> None:
        super().__init__(inner)
        self.methods, self.left, self.refused = methods, times, 0

    def _gate(self, method: str) -> None:
        if method in self.methods and self.left != 0:
            self.left -= 1
            self.refused += 1
            raise ThrottledError(f"{method}: HTTP 429 slow down")

    async def list_children(self, prefix: str = "") -> list[str]:
        self._gate("list_children")
        return await super().list_children(prefix)

    async def write(self, key: str, buffers: Any) -> None:
        self._gate("write")
        await super().write(key, buffers)


def test_a_throttled_call_is_retried_past_its_retries_and_the_budget_hears_of_each() -> None:
    """(How a budget answers throttles -- a cut on repeated bursts -- is tested on a fake clock above.)"""
    backend = Throttling(MemoryBackend(), ("write",), times=12)
    budget = RequestBudget(RequestRate(writes_per_s=1000))
    b = BudgetedBackend(backend, budget)
    policy = RetryPolicy(retries=2, backoff_initial=0.001, backoff_max=0.002, throttle_patience_s=30)
    asyncio.run(retry_call("write 'k'", lambda: b.write("k", [memoryview(b"x")]), policy))
    assert backend.refused == 12 and budget.throttles == 12
    assert asyncio.run(b.read("k")) == b"x"


def test_when_patience_runs_out_the_error_says_the_storage_is_throttled() -> None:
    backend = Throttling(MemoryBackend(), ("list_children",))
    policy = RetryPolicy(retries=1, backoff_initial=0.001, backoff_max=0.002, throttle_patience_s=0.05)
    with pytest.raises(ThrottledError, match="the storage is throttled: list '' was still refused"):
        asyncio.run(retry_call("list ''", lambda: backend.list_children(""), policy))


QUICK = EngineConfig(retries=1, backoff_initial=0.001, backoff_max=0.01, throttle_patience_s=0.1)


def test_a_throttled_listing_is_never_no_checkpoint(tmp_path: Path) -> None:
    ckptio.save(tmp_path, {"w": np.arange(10.0)}, step=3).result()
    throttled = Throttling(open_backend(str(tmp_path)), ("list_children",))
    with pytest.raises(ThrottledError, match="throttled") as e:
        ckptio.restore(tmp_path, backend=throttled, engine_config=QUICK)
    assert not isinstance(e.value, CheckpointNotFoundError)
    with ckptio.CheckpointManager(tmp_path, backend=throttled, engine_config=QUICK) as m:
        with pytest.raises(ThrottledError):
            m.restore()


def test_a_throttled_listing_on_host_0_is_never_no_checkpoint_on_any_host(tmp_path: Path) -> None:
    """Host 0 picks the step for the job: its throttled listing reaches every host as throttling,
    not as "no checkpoint" (on which a job would start from scratch)."""
    ckptio.save(tmp_path, {"w": np.arange(10.0)}, step=3).result()
    seen: list[BaseException] = []

    def host(rank: int, coord: Any) -> None:
        throttled = Throttling(open_backend(str(tmp_path)), ("list_children",))
        with ckptio.CheckpointManager(tmp_path, backend=throttled, engine_config=QUICK, coordinator=coord) as m:
            try:
                m.restore()
            except BaseException as e:  # noqa: BLE001 - judged below, host by host
                seen.append(e)

    on_hosts(2, host)
    assert len(seen) == 2
    for e in seen:
        assert isinstance(e, ThrottledError) and not isinstance(e, CheckpointNotFoundError), repr(e)
        assert "throttled" in str(e)


def test_two_processes_of_one_host_draw_from_one_share() -> None:
    """A host's trainer and its sidecar writer are one share of the job's rate: a process that
    joins the trainer's budget state (as the sidecar does) takes the slots after the trainer's,
    so the two together are spaced as one host's -- not two shares on one grid."""
    import subprocess
    import sys

    rate = RequestRate(writes_per_s=400, ramp_period_s=1e9, hosts=1, rank=0)
    trainer = RequestBudget(rate, clock=lambda: 1000.0)  # a still clock: slot times are exact
    fd = trainer.share_fd()
    mine = [1000.0 + trainer.reserve("write") for _ in range(20)]
    code = ("import sys; from ckptio.backends.budget import RequestBudget, RequestRate\n"
            "b = RequestBudget(RequestRate(writes_per_s=400, ramp_period_s=1e9, hosts=1, rank=0), clock=lambda: 1000.0)\n"
            "b.join(int(sys.argv[1]))\n"
            "print(' '.join(repr(1000.0 + b.reserve('write')) for _ in range(20)))\n")
    out = subprocess.run([sys.executable, "-c", code, str(fd)], pass_fds=[fd], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    theirs = [float(x) for x in out.split()]
    mine += [1000.0 + trainer.reserve("write") for _ in range(20)]
    times = sorted(mine + theirs)
    assert len(times) == 60
    assert np.diff(times).min() >= (1 / 400) * (1 - 1e-9), "two processes of one host sent within one slot"
    assert trainer.taken("write") == 60 and trainer.taken_here["write"] == 40, "the host's count is both processes'"


def test_a_host_alone_sends_at_the_jobs_rate_and_no_faster() -> None:
    """While every other host waits on this one (the coordinator's commit), it may use the job's
    whole rate, and no more; outside, its share again."""
    clock = Clock()
    b = RequestBudget(RequestRate(writes_per_s=100, ramp_period_s=1e9, hosts=50, rank=7), clock=clock)
    with b.alone():
        alone = slots(b, "write", 30, clock)
    assert np.diff(alone).min() >= (1 / 100) * (1 - 1e-9) and alone[-1] - alone[0] < 30 / 100
    clock.now = alone[-1] + 5.0
    after = slots(b, "write", 3, clock)
    assert np.diff(after).min() >= (50 / 100) / 1.125 ** 2 * (1 - 1e-9), "back to (about) its share of 2/s"


class _Paging(WrapperBackend):
    """Lists in ``pages`` requests through :func:`each_request`, as the GCS backend pages."""

    def __init__(self, inner: Any, pages: int) -> None:
        super().__init__(inner)
        self.pages = pages

    async def list_children(self, prefix: str = "") -> list[str]:
        from ckptio.backends.budget import each_request

        for _ in range(self.pages):
            await each_request("GET")
        return await super().list_children(prefix)


def test_each_request_of_a_call_takes_a_slot_of_its_own() -> None:
    """A listing of five pages is five requests against the budget, not one; without a budget
    above it, a backend's requests take nothing."""
    clock = Clock()
    budget = RequestBudget(RequestRate(reads_per_s=10, ramp_period_s=1e9, hosts=1, rank=0), clock=clock)
    b = BudgetedBackend(_Paging(MemoryBackend(), pages=5), budget)
    waits: list[float] = []
    real = budget.reserve

    def reserve(kind: str) -> float:
        waits.append(real(kind))
        return 0.0  # the slots are counted and placed; the test need not sleep through them

    budget.reserve = reserve  # type: ignore[method-assign]
    asyncio.run(b.list_children(""))
    assert budget.taken("read") == 5 and len(waits) == 5
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4]), "each page waits for its own slot"
    asyncio.run(_Paging(MemoryBackend(), pages=3).list_children(""))
    assert budget.taken("read") == 5



def test_no_descriptor_of_a_shared_state_is_closed_while_this_process_holds_its_lock() -> None:
    """Closing any descriptor of a file drops every lockf the process holds on it. Two budgets of one
    process joined to the host's state (the sidecar's engines of one storage): while one holds the
    state's lock, the other moving to another state must not close its descriptor under it."""
    import os
    import threading

    from lockprobe import locked_elsewhere

    from ckptio.backends._budget_slots import SlotState

    host = SlotState(0.0)
    fd = host.share()
    a, b = SlotState(0.0), SlotState(0.0)
    a.join(os.dup(fd))
    b.join(os.dup(fd))
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with a.locked():
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(60)
    other = SlotState(0.0)
    mover = threading.Thread(target=b.join, args=(os.dup(other.share()),), daemon=True)
    try:
        mover.start()
        mover.join(0.5)  # b's old descriptor of the host's state is closed only once a lets go
        assert locked_elsewhere(fd), "a closed descriptor dropped the lock another thread holds"
    finally:
        release.set()
    mover.join(60)
    holder.join(60)
    assert not mover.is_alive() and b.fd is not None and os.fstat(b.fd).st_ino == os.fstat(other.fd).st_ino


def test_a_state_that_cannot_be_joined_is_refused_and_its_descriptor_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """join() takes the descriptor on every path: a state too small, or one that cannot be mapped,
    is refused with a clear error and leaves no descriptor open behind it."""
    import mmap
    import os

    from ckptio.backends._budget_slots import SlotState

    def open_as(fd: int, name: str) -> bool:  # by /proc: a number reused by another open is not ours
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} ")
        except OSError:
            return False

    small = os.memfd_create("ckptio-test-too-small")
    with pytest.raises(ValueError, match="shared state must hold"):
        SlotState(0.0).join(small)
    assert not open_as(small, "ckptio-test-too-small")
    fd = os.dup(SlotState(0.0).share())
    assert open_as(fd, "ckptio-request-budget")

    def no_map(*a: Any, **kw: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_map)
    with pytest.raises(OSError, match="allocate"):
        SlotState(0.0).join(fd)
    assert not open_as(fd, "ckptio-request-budget")
