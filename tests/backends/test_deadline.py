"""Deadlines on storage calls (issue 38, part 2): a save or restore stuck on one object that never
answers fails, naming the host, the object and what it waited for, on every host, instead of hanging."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from paths import WORKERS

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.deadline import DeadlineBackend, DeadlineExceeded, Deadlines
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.stalling import StallingBackend
from ckptio.engine import EngineConfig
from ckptio.errors import CheckpointNotFoundError

QUICK = EngineConfig(retries=1, backoff_initial=0.001, backoff_max=0.01, deadlines=Deadlines(fixed_s=0.5))
#: A healthy host's deadlines beside a stuck one: far past any real call's time, even with the disk shared
#: by a parallel test run (a healthy host must learn of the stuck host's failure, not time out itself).
HEALTHY = EngineConfig(retries=1, backoff_initial=0.001, backoff_max=0.01, deadlines=Deadlines(fixed_s=60))
SHAPE = (4, 64)


def is_data(key: str) -> bool:
    """A data object (not a manifest, fragment, intent or fence: those are named ``ckptio.*``)."""
    return not key.rsplit("/", 1)[-1].startswith("ckptio.")


def chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def text(e: BaseException) -> str:
    return " | ".join(str(x) for x in chain(e))


def state(step: int) -> dict[str, Any]:
    return {"w": np.full(SHAPE, step, np.float32), "step": step}


def test_the_deadline_grows_with_the_size_and_the_measured_throughput() -> None:
    b = DeadlineBackend(MemoryBackend(), Deadlines(floor_s=2, slack=4, assumed_bps=1 << 20))
    assert b.deadline_for(0) == 2 and b.deadline_for(1 << 20) == pytest.approx(6)
    b._rates.extend([2 << 20, 8 << 20])  # the slowest recent call sets it
    assert b.deadline_for(1 << 20) == pytest.approx(4)
    assert DeadlineBackend(MemoryBackend(), Deadlines(fixed_s=7)).deadline_for(1 << 40) == 7, "the user's override"
    with pytest.raises(ValueError, match="floor_s"):
        Deadlines(floor_s=0)


def test_a_save_stuck_on_one_object_fails_naming_it_and_commits_nothing(tmp_path: Path) -> None:
    ckptio.save(tmp_path, state(1), step=1).result()
    stalling = StallingBackend(open_backend(str(tmp_path)), is_data, methods=("write",))
    with pytest.raises(BaseException) as e:
        ckptio.save(tmp_path, state(2), step=2, backend=stalling, engine_config=QUICK).result()
    deadline = next(x for x in chain(e.value) if isinstance(x, DeadlineExceeded))
    assert deadline.op == "writing" and is_data(deadline.key) and deadline.host
    assert deadline.key in text(e.value) and "did not finish within its deadline" in text(e.value)
    assert stalling.stalled >= 2, "tried again once, then gave up"
    assert ckptio.restore(tmp_path)["step"] == 1, "nothing of the stuck save was committed"


def test_a_restore_stuck_on_one_object_fails_naming_it(tmp_path: Path) -> None:
    ckptio.save(tmp_path, state(1), step=1).result()
    stalling = StallingBackend(open_backend(str(tmp_path)), is_data, methods=("read_into",))
    with pytest.raises(DeadlineExceeded) as e:
        ckptio.restore(tmp_path, backend=stalling, engine_config=QUICK)
    assert e.value.op.startswith("reading") and is_data(e.value.key) and e.value.key in str(e.value)
    assert not isinstance(e.value, CheckpointNotFoundError)


def test_a_host_stuck_on_one_object_fails_the_save_and_the_restore_on_every_host(tmp_path: Path) -> None:
    """Two hosts: host 1's writes, then its reads, never answer. Both hosts fail (neither hangs),
    and on both the error names host 1, its object and the call (host 0's through the verdict)."""
    rows = SHAPE[0] // 2
    full = np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)

    def piece(rank: int) -> tuple[slice, slice]:
        return slice(rank * rows, (rank + 1) * rows), slice(None)

    def run(methods: tuple[str, ...], do: Any) -> list[str]:
        def host(rank: int, coord: Any) -> str:
            backend = open_backend(str(tmp_path))
            if rank == 1:
                backend = StallingBackend(backend, is_data, methods=methods)
            try:
                do(rank, coord, backend)
            except BaseException as e:  # noqa: BLE001 - judged below
                return text(e)
            return "ok"

        return on_hosts(2, host, timeout=120)

    def save(rank: int, coord: Any, backend: Any) -> None:
        st = {"w": ckptio.Sharded(SHAPE, np.float32, [(piece(rank), full[piece(rank)])]), "step": 1}
        config = QUICK if rank == 1 else HEALTHY
        ckptio.save(tmp_path, st, step=1, coordinator=coord, backend=backend, engine_config=config).result()

    def restore(rank: int, coord: Any, backend: Any) -> None:
        target = {"w": ckptio.Sharded(SHAPE, np.float32, [(piece(rank), None)]), "step": None}
        config = QUICK if rank == 1 else HEALTHY
        with ckptio.CheckpointManager(tmp_path, coordinator=coord, backend=backend, engine_config=config) as m:
            m.restore(target=target)

    saved = run(("write",), save)
    assert all("did not finish within its deadline" in m and "writing" in m for m in saved), saved
    assert "host 1" in saved[0], "host 0 is told which host, object and call held the save up"
    with pytest.raises(CheckpointNotFoundError):
        ckptio.restore(tmp_path)
    ckptio.save(tmp_path, {"w": full, "step": 1}, step=1).result()  # one host saves it whole
    restored = run(("read_into",), restore)
    assert all("did not finish within its deadline" in m and "reading" in m for m in restored), restored
    assert "host 1" in restored[0]


@pytest.mark.slow  # two real processes wait out a deadline
@pytest.mark.parametrize("mode", ["save", "restore"])
def test_two_real_processes_fail_by_name_when_one_object_never_answers(tmp_path: Path, mode: str) -> None:
    """torch.distributed (gloo), 2 processes: rank 1's data objects never answer. Both ranks exit
    having failed with the deadline error (rank 0's names host 1), well before the spawn's timeout."""
    pytest.importorskip("torch")
    from ckptio.bench.readonce import spawn

    root = str(tmp_path / "ckpt")
    if mode == "restore":
        full = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
        ckptio.save(root, {"w": full, "step": 1}, step=1).result()
    spawn(str(WORKERS / "stall_worker.py"), 2, [mode, root], timeout=120)
