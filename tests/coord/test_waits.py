"""Deadlines on collective waits (issue 38, what was left of part 2): a host that stops outside
storage at a collective point of a save or a restore fails the others within their deadline,
naming it and the wait, instead of hanging them until the framework's timeout."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paths import WORKERS

import ckptio
from ckptio.backends.deadline import Deadlines
from ckptio.coord.waits import CollectiveTimeout, current, missing_message, waiting_for
from ckptio.engine import UNLABELLED_S, EngineConfig
from ckptio.errors import CheckpointNotFoundError


def test_the_collective_deadline_grows_with_the_io_it_covers_and_the_user_can_fix_it() -> None:
    d = Deadlines(collective_floor_s=100, slack=2, assumed_bps=1 << 20)
    assert d.collective_s() == 100
    assert d.collective_s(10 << 20) == 120
    assert d.collective_s(10 << 20, extra_s=5) == 125
    assert Deadlines(collective_fixed_s=7).collective_s(1 << 40, extra_s=600) == 7
    # The engine's throttle patience is part of it: hosts sitting out throttling are not "gone".
    assert EngineConfig(deadlines=d, throttle_patience_s=30).collective_deadline_s(0) == 130
    assert EngineConfig(deadlines=None).collective_deadline_s(1 << 30) == UNLABELLED_S
    with pytest.raises(ValueError, match="collective_fixed_s"):
        Deadlines(collective_fixed_s=0)


def test_waits_are_labelled_per_thread_and_nest() -> None:
    assert current().deadline_s == UNLABELLED_S
    with waiting_for("commit of step 40", 120):
        with waiting_for("inner", 5):
            assert current().what == "inner"
        assert current().what == "commit of step 40"
        seen: list[float] = []
        t = threading.Thread(target=lambda: seen.append(current().deadline_s))
        t.start()
        t.join()
        assert seen == [UNLABELLED_S]  # another thread's collectives are not this wait
    assert current().deadline_s == UNLABELLED_S
    w = waiting_for("commit of step 40", 120).__enter__()
    assert missing_message(w, [7, 3]) == "commit of step 40: hosts 3, 7 did not report within 120 s"
    assert "and 4 more" in missing_message(w, range(20))


def _gates(size: int) -> list[Any]:
    dist = pytest.importorskip("torch.distributed")
    from ckptio.coord.storegate import StoreGate

    server = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    port = server.port
    clients = [server] + [dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=60))
                          for _ in range(size - 1)]
    return [StoreGate(dist.PrefixStore("ckptio/t", c), r, size) for r, c in enumerate(clients)]


def _on_threads(gates: list[Any], body: Any) -> list[Any]:
    out: list[Any] = [None] * len(gates)

    def run(r: int) -> None:
        try:
            out[r] = body(r, gates[r])
        except BaseException as e:  # noqa: BLE001 - judged by the caller
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(gates))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a host hung at the gate"
    return out


def test_the_gate_passes_healthy_hosts_through_many_collectives() -> None:
    def body(rank: int, gate: Any) -> int:
        with waiting_for("healthy", 30):
            for _ in range(25):
                gate.enter()
        return 25

    assert _on_threads(_gates(4), body) == [25] * 4


@pytest.mark.parametrize("absent", [0, 2])
def test_a_host_that_never_arrives_fails_every_waiting_host_naming_it(absent: int) -> None:
    """Host ``absent`` stops after one collective; every other host fails at the second within
    about its deadline (two, for a host that waits for host 0's verdict), naming it and the wait,
    and a later collective is refused rather than run out of step."""
    def body(rank: int, gate: Any) -> Any:
        with waiting_for("commit of step 40", 1.0):
            gate.enter()
            if rank == absent:
                return "stopped"
            try:
                gate.enter()
            except CollectiveTimeout as e:
                with pytest.raises(CollectiveTimeout, match="out of step"):
                    gate.enter()
                return e
        return "passed"

    out = _on_threads(_gates(3), body)
    for rank, e in enumerate(out):
        if rank == absent:
            continue
        assert isinstance(e, CollectiveTimeout), (rank, e)
        assert e.hosts == (absent,) and "commit of step 40" in str(e) and f"host {absent} did not" in str(e)


def test_host_zero_arriving_after_a_host_gave_up_on_it_aborts_instead_of_hanging() -> None:
    import time

    def body(rank: int, gate: Any) -> Any:
        with waiting_for("choice of the step", 1.0):
            if rank == 0:
                time.sleep(3.0)  # past host 1's deadline: host 1 gives up and leaves
            try:
                gate.enter()
            except CollectiveTimeout as e:
                return e
        return "passed"

    out = _on_threads(_gates(2), body)
    assert isinstance(out[1], CollectiveTimeout) and "host 0 did not answer" in str(out[1])
    assert isinstance(out[0], CollectiveTimeout) and "host 1 gave up waiting" in str(out[0])


@pytest.mark.slow
@pytest.mark.parametrize("framework, mode", [("torch", "save"), ("torch", "pick"), ("torch", "outcome"),
                                             ("torch", "readonce"), ("jax", "save"), ("jax", "pick")])
def test_two_real_processes_fail_by_name_when_one_stops_at_a_collective(tmp_path: Path, framework: str,
                                                                         mode: str) -> None:
    """torch.distributed (gloo) or jax.distributed (CPU), 2 processes, one stops outside storage at a collective point of a
    save (before the commit) or a restore (the choice of step, the outcome, a read-once round):
    both fail naming it and the wait, the others within the deadline (tests/workers/collective_wait_worker.py
    checks each rank); the committed step before it still restores and nothing new is committed."""
    pytest.importorskip(framework)
    from ckptio.bench.readonce import spawn

    root = str(tmp_path / "ckpt")
    full = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    ckptio.save(root, {"w": full, "step": 1}, step=1).result()
    spawn(str(WORKERS / "collective_wait_worker.py"), 2, [mode, root, framework], timeout=120)
    got = ckptio.restore(root, step=None)
    assert got["step"] == 1 and np.array_equal(got["w"], full)
    with pytest.raises(CheckpointNotFoundError):
        ckptio.restore(root, step=2)


# -- jax's key-value protocol, hosts as threads ---------------------------------------------------


def _jax_hosts(size: int, body: Any) -> list[Any]:
    from tests.coord.test_distributed import _FakeClient, _FakeKV

    from ckptio.coord.distributed import JaxCoordinator

    class Client(_FakeClient):
        def key_value_try_get(self, key: str) -> str:
            with self.kv._cond:
                if key not in self.kv.kv:
                    raise KeyError(key)  # the service raises NOT_FOUND
                return self.kv.kv[key]

    kv = _FakeKV()
    coords = [JaxCoordinator("t", client=Client(kv, r), rank=r, size=size) for r in range(size)]
    return _on_threads(coords, body)


def test_jax_a_host_missing_at_the_gather_fails_host_0_and_the_hosts_awaiting_its_verdict() -> None:
    """Host 2 never reports: host 0's gather names it; host 1, waiting for the verdict, gets host 0's
    reason (not "host 0 did not answer"); later collectives are refused."""
    def body(rank: int, c: Any) -> Any:
        if rank == 2:
            return "stopped"
        with waiting_for("commit of step 40", 1.0):
            try:
                c.gather({"rank": rank})
                c.broadcast({"ok": True})
            except CollectiveTimeout as e:
                with pytest.raises(CollectiveTimeout, match="out of step"):
                    c.broadcast(None)
                return e
        return "passed"

    out = _jax_hosts(3, body)
    for e in out[:2]:
        assert isinstance(e, CollectiveTimeout) and e.hosts == (2,), e
        assert "commit of step 40: host 2 did not report within 1 s" in str(e)


def test_jax_a_missing_host_0_is_named_by_every_host_awaiting_it() -> None:
    def body(rank: int, c: Any) -> Any:
        if rank == 0:
            return "stopped"
        with waiting_for("choice of the step", 0.5):
            try:
                c.broadcast(None)
            except CollectiveTimeout as e:
                return e
        return "passed"

    out = _jax_hosts(3, body)
    for e in out[1:]:
        assert isinstance(e, CollectiveTimeout) and e.hosts == (0,), e
        assert "choice of the step: host 0 did not answer" in str(e)
