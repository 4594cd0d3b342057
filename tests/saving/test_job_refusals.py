"""Found by the format-2 crash campaign: a gc at grace 0 beside running saves, and a save refused
on one host before its collectives."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

import ckptio
from ckptio.engine import run_sync
from ckptio.store import CheckpointStore


def test_a_sweep_at_grace_0_spares_the_temporaries_of_a_save_in_flight(tmp_path: Path) -> None:
    """Temporaries go only a lease after their last byte, whatever the grace: at grace 0 a sweep
    used to pull the temporary of every write in flight (FileNotFoundError "writing
    '<step>/ckptio.intent.<id>': no such file"). Deleters spare a save in flight, whatever its age."""
    root = str(tmp_path)
    stop = threading.Event()

    def sweeper() -> None:
        store = CheckpointStore(root)
        while not stop.is_set():
            run_sync(store.sweep(0))

    t = threading.Thread(target=sweeper)
    t.start()
    failures: list[str] = []
    try:
        for step in range(1, 11):
            try:
                ckptio.save(root, {"w": np.arange(1 << 18, dtype=np.float32)}, step=step).result()
            except Exception as e:  # noqa: BLE001 -- any failure is the finding
                failures.append(repr(e))
    finally:
        stop.set()
        t.join()
    assert failures == [], failures[:3]


def test_a_save_refused_on_one_host_before_its_collectives_keeps_the_job_in_step(tmp_path: Path) -> None:
    """A save that raises on the calling thread on one host (a bad leaf, prepare_save, the intent
    write) still joins the gather with a failure record: step s fails on every host, and step s+1
    pairs up and commits (it used to pair with the other hosts' step s, one step out of phase)."""
    import hosts

    def state(rank: int, bad: bool) -> dict:
        w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
        ix = (slice(rank * 32, (rank + 1) * 32), slice(None))
        out = {"w": ckptio.Sharded(w.shape, w.dtype, [(ix, w[ix])])}
        if bad:
            out["bad"] = object()  # refused while staging, before anything is written
        return out

    group = hosts._ThreadGroup(2)
    group._barrier = threading.Barrier(2, timeout=15)
    outcome: dict[tuple[int, int], str] = {}

    def host(rank: int) -> None:
        coord = group.member(rank)
        for step in (2, 3):
            try:
                ckptio.save(str(tmp_path), state(rank, bad=rank == 1 and step == 2), step=step,
                            coordinator=coord).result()
                outcome[(rank, step)] = "ok"
            except Exception as e:  # noqa: BLE001
                outcome[(rank, step)] = type(e).__name__

    threads = [threading.Thread(target=host, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome.get((0, 3)) == "ok" and outcome.get((1, 3)) == "ok", outcome
    assert outcome.get((0, 2)) not in (None, "ok"), outcome


def test_a_resave_of_a_committed_step_is_refused_on_every_host_and_leaves_no_intent(tmp_path: Path) -> None:
    """Each host checks the step while it announces its save (not before): a host that finds the
    step committed retires the intent it just wrote, so a refused re-save leaves the step exactly
    as it was -- no intent, and the committed checkpoint still restores."""
    from hosts import on_hosts

    from ckptio.manifest.names import parse_intent

    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)

    def state(rank: int) -> dict:
        ix = (slice(rank * 32, (rank + 1) * 32), slice(None))
        return {"w": ckptio.Sharded(w.shape, w.dtype, [(ix, w[ix])])}

    def save(rank: int, coord: object) -> str:
        try:
            ckptio.save(str(tmp_path), state(rank), step=5, coordinator=coord).result()
            return "ok"
        except FileExistsError:
            return "refused"

    assert on_hosts(2, save) == ["ok", "ok"]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert on_hosts(2, save) == ["refused", "refused"]
    store = CheckpointStore(str(tmp_path))
    try:
        listed = run_sync(store.backend.list(""))
    finally:
        run_sync(store.close())
    assert [i.key for i in listed if parse_intent(i.key)] == []
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    out = ckptio.restore(str(tmp_path), step=5, target={"w": w})
    assert np.array_equal(out["w"], w)
