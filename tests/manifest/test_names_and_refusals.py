"""Issue 30 ("never lose, round 2"), items 3 and 6.

3: objects of hosts or object numbers past 99999 (and of a fan-out past 999, a hashed
   component past 4 hex digits) parse as ckptio's, so gc and delete remove them; their
   lookalikes are still someone else's.
6: a manifest whose tree holds an unknown node kind, or whose array has a zero dimension beside
   dimensions no array can have, is a ManifestError (restore, read_manifest, ls, inspect); a gc
   grace that is not a finite number >= 0 is refused, on the command line and from Python.

Each test failed on the tree before the fix, but the three marked as guards: they hold the fixes
to what must not change (lookalikes, replica markers, empty arrays numpy can make).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts
from manifests import as_rows, edit_manifest

import ckptio
from ckptio.cli import main as cli
from ckptio.engine import run_sync
from ckptio.engine.layout import FanoutNaming, FlatNaming, HashedNaming, Naming
from ckptio.manifest import MANIFEST_NAME, seal, unseal
from ckptio.manifest.names import ObjectName, is_fencing, parse_object, parse_replica_mark, replica_mark_key
from ckptio.store import CheckpointStore

SID = "0123456789ab"
WIDE = [(123456, 100000), (3, 123456), (123456, 7), (10**9, 10**9)]


def old_file(root: Path, key: str) -> None:
    """A file at ``key`` older than any grace a test passes (a crashed save's object)."""
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    past = time.time() - 7200
    os.utime(path, (past, past))


def left(root: Path) -> set[str]:
    # Revocations (ckptio.store.fence) are kept forever by design: not leftovers.
    return {k for p in root.rglob("*") if p.is_file() and not is_fencing(k := str(p.relative_to(root)))}


# -- 3. every key the layouts write parses, at any width ----------------------------------------------

@pytest.mark.parametrize("naming", [FlatNaming(), FanoutNaming(16), FanoutNaming(5000), HashedNaming(),
                                    HashedNaming(chars=6)], ids=repr)
@pytest.mark.parametrize(("host", "n"), WIDE)
def test_every_key_a_layout_writes_for_wide_numbers_parses(naming: Naming, host: int, n: int) -> None:
    key = naming.object_key("7", SID, host, host + 1, n)
    assert parse_object(key) == ObjectName("7", SID), key


def test_every_fanout_directory_past_999_parses() -> None:
    naming = FanoutNaming(2000)
    keys = [naming.object_key("7", SID, 0, 1, n) for n in range(2000)]
    assert any("/d1999/" in k for k in keys)
    assert [k for k in keys if parse_object(k) != ObjectName("7", SID)] == []


LOOKALIKES = [f"7/{SID}.h000001-00000", f"7/{SID}.h1-00000", f"7/{SID}.h00001-000001", f"7/{SID}.h00001-1",
              f"7/{SID}.h0123456-00000", f"7/d0001/{SID}.h00001-00000", f"7/d01/{SID}.h00001-00000",
              f"7/{SID}.h123456-100000.bak", f"h3f/7/x/{SID}.h123456-00000"]


def test_lookalikes_of_wide_numbers_never_parse() -> None:
    """A guard: widening the numbers must not let a spelling the layouts never write parse."""
    assert [k for k in LOOKALIKES if parse_object(k) is not None] == []


def test_replica_marks_of_wide_hosts_parse_and_their_lookalikes_do_not() -> None:
    """A guard: replica markers, also ``{:05d}``, already parse at any width (by a round trip)."""
    assert parse_replica_mark(replica_mark_key("7", 123456)).host == 123456  # type: ignore[union-attr]
    assert parse_replica_mark("7/ckptio.replica-of.h0123456") is None


def wide_orphans() -> list[str]:
    """Keys a killed save of step 7 left: flat, fanned out, hashed (2 and 6 hex digits)."""
    out = [FlatNaming().object_key("7", SID, h, h + 1, n) for h, n in WIDE]
    out += [FanoutNaming(5000).object_key("7", SID, 4321, 4322, 0)]  # d4321
    out += [HashedNaming(chars=c).object_key("7", SID, 123456, 123457, 100000) for c in (2, 6)]
    return out


@pytest.mark.parametrize("how", ["gc", "sweep_step", "delete"])
def test_gc_and_delete_remove_objects_of_wide_hosts_and_numbers(tmp_path: Path, how: str) -> None:
    ckptio.save(tmp_path, {"w": np.arange(10)}, step=5).result()
    committed = left(tmp_path)
    orphans = wide_orphans()
    lookalikes = [*LOOKALIKES, "h0a1b2c/7/notes.txt"]
    for key in orphans + lookalikes:
        old_file(tmp_path, key)
    store = CheckpointStore(str(tmp_path))
    if how == "gc":
        report = run_sync(store.sweep(0.0))
        assert sorted(report.objects) == sorted(orphans)
    elif how == "sweep_step":
        assert sorted(run_sync(store.sweep_step(7, 0.0)).objects) == sorted(orphans)
    else:
        run_sync(store.delete("7"))
    run_sync(store.close())
    assert left(tmp_path) == committed | set(lookalikes)
    assert ckptio.restore(tmp_path, step=5)["w"].tolist() == list(range(10))


def test_deleting_a_committed_step_removes_wide_orphans_beside_it(tmp_path: Path) -> None:
    ckptio.save(tmp_path, {"w": np.arange(10)}, step=7).result()
    orphans = [FlatNaming().object_key("7", SID, h, h + 1, n) for h, n in WIDE]
    for key in orphans + LOOKALIKES[:5]:
        old_file(tmp_path, key)
    store = CheckpointStore(str(tmp_path))
    run_sync(store.delete("7"))
    run_sync(store.close())
    assert left(tmp_path) == set(LOOKALIKES[:5])


# -- 6a. malformed trees and impossible shapes are ManifestErrors -------------------------------------

def assert_damaged(root: Path, step: int, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every reader reports the step as damaged, naming ``match``; none crashes."""
    with pytest.raises(ckptio.ManifestError, match=re.escape(match)):
        ckptio.restore(root, step=step)
    store = CheckpointStore(str(root))
    with pytest.raises(ckptio.ManifestError, match=re.escape(match)):
        run_sync(store.read_manifest(str(step)))
    run_sync(store.close())
    capsys.readouterr()
    assert cli(["inspect", str(root), "--step", str(step)]) == 4
    err = capsys.readouterr().err
    assert err.startswith("ckptio: error: ") and err.count("\n") == 1 and match in err.replace("\\'", "'")
    assert cli(["ls", str(root), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "damaged" and match in row["problem"]


def plain_state() -> dict[str, Any]:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(5), "s": 3}


Edit = Callable[[dict[str, Any]], Any]

TREES: dict[str, Edit] = {
    "unknown kind at the root": lambda d: d.update(tree={"zzz": [d["tree"]]}),
    "unknown kind inside": lambda d: d["tree"]["dict"].update(w={"zzz": [{"leaf": "w"}]}),
    "list with a dict body": lambda d: d["tree"]["dict"].update(x={"list": {}}),
    "key node of two children": lambda d: d["tree"]["dict"].update(
        w={"prng_key:threefry2x32": [{"leaf": "w"}, {"leaf": "b"}]}),
}


def zero_sized(shape: list[int], shards: list[tuple[list[int], list[int]]]) -> Edit:
    """An edit making item ``w`` an empty array of ``shape`` saved as ``shards`` (offsets, shape)."""
    def edit(doc: dict[str, Any]) -> None:
        as_rows(doc)  # w and b out of their pack table, so that w can be replaced alone
        shard_docs = [{"offsets": o, "shape": s, "host": 0, "extents": []} for o, s in shards]
        doc["items"]["w"] = {"kind": "array", "dtype": "<f4", "shape": shape, "scalar": False,
                             "origin": "numpy", "shards": shard_docs}
    return edit


BIG = 1 << 62
SHAPES = {
    "[0, 2**62]": zero_sized([0, BIG], [([0, 0], [0, BIG])]),
    "[2**62, 0]": zero_sized([BIG, 0], [([0, 0], [BIG, 0])]),
    "no shards": zero_sized([0, BIG], []),
    "a shard at a huge offset": zero_sized([0, BIG], [([0, BIG - 1], [0, 1])]),
    "two shards": zero_sized([0, BIG], [([0, 0], [0, 5]), ([0, BIG - 5], [0, 5])]),
    "huge dims whose product overflows": zero_sized([0, BIG, BIG], [([0, 0, 0], [0, BIG, BIG])]),
    "64 dims": zero_sized([BIG] * 63 + [0], [([0] * 64, [BIG] * 63 + [0])]),
    "2**61 float32": zero_sized([0, 1 << 61], [([0, 0], [0, 1 << 61])]),
}


#: Each damage, and what its ManifestError names.
CASES = [*((name, edit, "malformed tree") for name, edit in TREES.items()),
         *((f"zero size, {name}", edit, "item 'w': shape [") for name, edit in SHAPES.items())]


@pytest.mark.parametrize(("edit", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_trees_and_impossible_shapes_are_manifest_errors(
    tmp_path: Path, edit: Any, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckptio.save(tmp_path, plain_state(), step=1).result()
    edit_manifest(tmp_path, edit)
    assert_damaged(tmp_path, 1, match, capsys)


def test_zero_size_items_numpy_can_make_still_restore(tmp_path: Path) -> None:
    """A guard: the shape check refuses only what numpy cannot make."""
    ckptio.save(tmp_path, plain_state(), step=1).result()
    edit_manifest(tmp_path, zero_sized([0, 1 << 60], [([0, 0], [0, 5]), ([0, (1 << 60) - 5], [0, 5])]))
    assert ckptio.restore(tmp_path, step=1)["w"].shape == (0, 1 << 60)


def _locator(rows: list[list[int]]) -> str:
    return base64.b64encode(zlib.compress(np.asarray(rows, np.int64).tobytes())).decode()


@pytest.mark.parametrize(("shape", "row"), [
    ([0, BIG], [0, 0, 0, 0, BIG]),
    ([0, 8], [0, 0, 2**63 - 1, 0, 2]),  # offset + size wraps int64: outside the array all the same
    ([2, 8], [0, 0, 2**63 - 1, 2, 8]),
], ids=["huge", "wrap", "wrap nonempty"])
def test_format2_roots_with_impossible_shapes_or_wrapping_shards_are_manifest_errors(
    tmp_path: Path, shape: list[int], row: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    def host_state(rank: int) -> dict[str, Any]:
        rows = (slice(rank * 2, rank * 2 + 2),)
        return {"w": ckptio.Sharded((4, 8), np.float32, [(rows, np.ones((2, 8), np.float32))])}

    on_hosts(2, lambda rank, coord: ckptio.save(tmp_path, host_state(rank), step=3,
                                                coordinator=coord).result())
    path = tmp_path / "3" / MANIFEST_NAME
    doc = json.loads(unseal(path.read_bytes(), "root"))
    assert "fragments" in doc
    doc["items"]["w"].update(shape=shape, locator="bad")
    doc["locators"]["bad"] = _locator([row])
    path.write_bytes(seal(doc))
    assert_damaged(tmp_path, 3, "item 'w'", capsys)


# -- 6b. a gc grace must be a finite number of seconds >= 0 --------------------------------------------

@pytest.mark.parametrize("grace", ["-5", "nan", "inf", "-inf", "1e999", "soon"])
def test_gc_refuses_a_grace_that_is_not_a_finite_number_at_least_zero(
    tmp_path: Path, grace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = f"2/{SID}.h00000-00000"
    old_file(tmp_path, orphan)
    assert cli(["gc", str(tmp_path), f"--grace={grace}"]) == 2  # "-inf" is an option to argparse otherwise
    err = capsys.readouterr().err
    assert err.startswith("ckptio: error: argument --grace: must be a finite number") and err.count("\n") == 1
    assert left(tmp_path) == {orphan}
    assert cli(["gc", str(tmp_path), "--grace", "0"]) == 0
    assert left(tmp_path) == set()


@pytest.mark.parametrize("grace", [-5.0, -1, math.nan, math.inf, True, "0"])
def test_sweeps_refuse_a_grace_that_is_not_a_finite_number_at_least_zero(tmp_path: Path, grace: Any) -> None:
    orphan = f"2/{SID}.h00000-00000"
    old_file(tmp_path, orphan)
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(ValueError, match="grace_seconds must be a finite number"):
        run_sync(store.sweep(grace))
    with pytest.raises(ValueError, match="grace_seconds must be a finite number"):
        run_sync(store.sweep_step(2, grace))
    mngr = ckptio.CheckpointManager(str(tmp_path))
    with pytest.raises(ValueError, match="grace_seconds must be a finite number"):
        mngr.sweep_orphans(grace)
    mngr.close()
    run_sync(store.close())
    assert left(tmp_path) == {orphan}
