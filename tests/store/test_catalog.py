"""'Latest' is the newest restorable step; retention never trusts a step that lost data (issue #30).

A newest step that lost an object (format 1) or a fragment (format 2: missing,
truncated, flipped, copied from another root), or whose manifest cannot be read
(permission denied), is reported by name and skipped: restore() takes the older
intact step, retention neither counts it as kept nor deletes for it, and
``ckptio ls`` marks it. restore(step=N) still raises, naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.cli import main as cli
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME
from ckptio.store import CheckpointStore

SHAPE = (4, 600)


def state_for(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(SHAPE).astype(np.float32), "b": rng.integers(0, 9, 50_000, np.int64),
            "step": step}


def save_one_host(root: Path, step: int) -> None:
    ckptio.save(root, state_for(step), step=step).result()


def save_two_hosts(root: Path, step: int) -> None:
    """Format 2: two hosts, each writing its half of ``w`` and its own fragment."""
    full = state_for(step)

    def host(rank: int, coord: Any) -> None:
        rows = slice(rank * 2, rank * 2 + 2)
        st = {"w": ckptio.Sharded(SHAPE, np.float32, [((rows, slice(None)), full["w"][rows])]),
              "b": full["b"], "step": step}
        ckptio.save(root, st, step=step, coordinator=coord).result()

    on_hosts(2, host)


def data_objects(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.iterdir() if not p.name.startswith("ckptio."))


def fragments(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("ckptio.fragment.*"))


def flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE: dict[str, tuple[Callable[[Path, int], None], Callable[[Path], None]]] = {
    "f1-object-missing": (save_one_host, lambda d: data_objects(d)[0].unlink()),
    "f1-object-truncated": (save_one_host, lambda d: truncate(data_objects(d)[-1])),
    "f2-fragment-missing": (save_two_hosts, lambda d: fragments(d)[1].unlink()),
    "f2-fragment-truncated": (save_two_hosts, lambda d: truncate(fragments(d)[0])),
    "f2-fragment-flipped": (save_two_hosts, lambda d: flip(fragments(d)[0])),
    "f2-object-missing": (save_two_hosts, lambda d: data_objects(d)[0].unlink()),
}


def same(got: dict[str, Any], step: int) -> bool:
    want = state_for(step)
    return all(np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want)


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_restore_latest_falls_back_past_a_step_that_lost_data(tmp_path: Path, case: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    save, damage = DAMAGE[case]
    for step in (1, 2):
        save(tmp_path, step)
    damage(tmp_path / "2")
    assert same(ckptio.restore(tmp_path), 1)  # the newest restorable
    with pytest.raises((FileNotFoundError, ckptio.IntegrityError, ckptio.ManifestError)) as e:
        ckptio.restore(tmp_path, step=2)
    assert "2" in str(e.value)
    with ckptio.CheckpointManager(tmp_path) as m:
        assert same(m.restore(), 1)
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["state"] == "committed"
    # ls checks with a listing (sizes): a lost or short object or fragment of the root's; a flipped
    # byte, or a format-2 data object (named in a fragment), is found by verify and by restore.
    if case.startswith("f1") or case in ("f2-fragment-missing", "f2-fragment-truncated"):
        assert rows[2]["state"] == "damaged" and not rows[2]["committed"]
    assert cli(["verify", str(tmp_path), "--step", "2"]) != 0


def test_a_copied_fragment_from_another_root_is_not_restored(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for step in (1, 2):
        save_two_hosts(a, step)
    save_two_hosts(b, 2)
    ours, theirs = fragments(a / "2")[0], fragments(b / "2")[0]
    shutil.copyfile(theirs, ours)  # same name length, another checkpoint's content
    assert same(ckptio.restore(a), 1)


@pytest.mark.parametrize("case", ["f1-object-missing", "f2-fragment-missing"])
def test_retention_never_counts_a_step_that_lost_data(tmp_path: Path, case: str) -> None:
    """max_to_keep=2, saves of 1..4, step 3 damaged before 4: step 2 must stay (only 4 is whole)."""
    save, damage = DAMAGE[case]
    for step in (1, 2, 3):
        save(tmp_path, step)
    damage(tmp_path / "3")
    if case.startswith("f1"):
        with ckptio.CheckpointManager(tmp_path, max_to_keep=2) as m:
            m.save(4, state_for(4))
    else:
        full = state_for(4)

        def host(rank: int, coord: Any) -> None:
            rows = slice(rank * 2, rank * 2 + 2)
            st = {"w": ckptio.Sharded(SHAPE, np.float32, [((rows, slice(None)), full["w"][rows])]),
                  "b": full["b"], "step": 4}
            with ckptio.CheckpointManager(tmp_path, max_to_keep=2, coordinator=coord) as m:
                m.save(4, st)

        on_hosts(2, host)
    assert (tmp_path / "2" / MANIFEST_NAME).exists(), "retention deleted the step a restore needs"
    assert (tmp_path / "3" / MANIFEST_NAME).exists(), "retention deleted a damaged step (kept for inspection)"
    assert not (tmp_path / "1" / MANIFEST_NAME).exists()
    assert same(ckptio.restore(tmp_path, step=2), 2) and same(ckptio.restore(tmp_path), 4)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_newest_manifest_is_listed_and_skipped_unprivileged(tmp_path: Path) -> None:
    save_one_host(tmp_path, 1)
    save_one_host(tmp_path, 2)
    (tmp_path / "2" / MANIFEST_NAME).chmod(0)
    assert same(ckptio.restore(tmp_path), 1)


def test_unreadable_newest_manifest_is_listed_and_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Permission denied on the newest manifest (as for a non-root user, or an IAM rule on GCS)."""
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import WrapperBackend

    class Denied(WrapperBackend):
        async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
            if key == f"2/{MANIFEST_NAME}":
                raise PermissionError(f"{key}: permission denied")
            await super().read_into(key, rng, buffers)

    save_one_host(tmp_path, 1)
    save_one_host(tmp_path, 2)
    backend = Denied(open_backend(str(tmp_path)))
    assert same(ckptio.restore(tmp_path, backend=backend), 1)
    store = CheckpointStore(tmp_path, backend=Denied(open_backend(str(tmp_path))))
    try:
        assert run_sync(store.status("2")).state == "unreadable"
        assert run_sync(store.status("1")).state == "committed"
        assert run_sync(store.intact_steps()) == [1]
    finally:
        run_sync(store.close())


def test_hosts_decide_together_when_only_one_host_cannot_restore_the_newest(tmp_path: Path) -> None:
    """Format 2: host 1's rows of step 2 lost an object only host 1 reads. Host 0 alone would
    restore step 2; through the manager every host restores step 1, the same step."""
    for step in (1, 2):
        save_two_hosts(tmp_path, step)
    store = CheckpointStore(tmp_path)
    m = run_sync(store.read_manifest("2"))
    run_sync(store.close())
    mine = {e.object for s in m.items["w"].shards if s.host == 1 for e in s.extents}
    (tmp_path / m.objects[sorted(mine)[0]]).unlink()

    def host(rank: int, coord: Any) -> int:
        rows = slice(rank * 2, rank * 2 + 2)
        target = {"w": ckptio.Sharded(SHAPE, np.float32, [((rows, slice(None)), None)]), "b": None, "step": None}
        with ckptio.CheckpointManager(tmp_path, coordinator=coord) as mngr:
            out = mngr.restore(target=target)
        want = state_for(out["step"])
        assert out["w"].pieces[0][1].tobytes() == np.ascontiguousarray(want["w"][rows]).tobytes()
        return int(out["step"])

    assert on_hosts(2, host) == [1, 1]
