"""The bench's host processes (``ckptio bench --rate-limit R --host-processes``): forked hosts whose
collectives the parent relays. Every collective gives each host what a real coordinator would, and a
host that dies fails the run instead of hanging it."""

from __future__ import annotations

import os
from typing import Any

from ckptio.bench.hostprocs import HostProcesses
from ckptio.coord.collective import collective_verdict


def _collectives(rank: int, coord: Any, *, tag: str) -> dict[str, Any]:
    everyone = coord.all_gather({"rank": rank, "tag": tag})
    gathered = coord.gather(rank * 10)
    said = coord.broadcast({"from": rank} if rank == 0 else None)
    again = coord.all_gather(rank)  # the rounds after a gather and a broadcast still pair up
    return {"everyone": everyone, "gathered": gathered, "said": said, "again": again,
            "pid": os.getpid(), "size": coord.size}


def _verdict(rank: int, coord: Any, *, fail: int) -> Any:
    record = {"ok": False, "error": "no"} if rank == fail else {"ok": True}
    committed: list[int] = []
    v = collective_verdict(coord, record, lambda records: committed.append(len(records)))
    return [v.ok, v.error, committed]


def _die(rank: int, coord: Any) -> Any:
    if rank == 1:
        os._exit(3)
    return coord.all_gather(rank)  # waits on the dead host


def test_each_host_is_a_process_and_every_collective_answers_as_a_coordinator_would() -> None:
    with HostProcesses(3, {"c": _collectives, "v": _verdict}, timeout=60) as hosts:
        first = hosts.run("c", {"tag": "x"})
        second = hosts.run("c", {"tag": "y"})  # the hosts live on: a second phase pairs up too
        verdicts = hosts.run("v", {"fail": -1})
        failed = hosts.run("v", {"fail": 2})
    assert len({r["pid"] for r in first} | {os.getpid()}) == 4
    for out, tag in ((first, "x"), (second, "y")):
        for rank, r in enumerate(out):
            assert r["size"] == 3 and r["everyone"] == [{"rank": h, "tag": tag} for h in range(3)]
            assert r["gathered"] == ([0, 10, 20] if rank == 0 else None)
            assert r["said"] == {"from": 0} and r["again"] == [0, 1, 2]
    assert verdicts == [[True, "", [3]], [True, "", []], [True, "", []]]
    assert [v[:2] for v in failed] == [[False, "no"]] * 3 and failed[0][2] == []


def test_a_host_that_dies_fails_the_run_on_every_host_instead_of_hanging_it() -> None:
    hosts = HostProcesses(3, {"die": _die}, timeout=60)
    out = hosts.run("die", {})
    assert "host 1: die: its process died (exit code 3)" == out[1]
    assert all(o.startswith(f"host {r}: die: ") for r, o in enumerate(out)), out
    hosts.close()  # closed already: a no-op
