"""A format-2 restore planned and read in batches of fragments (ckptio.restoring.batches): with a
budget so small that every fragment is a batch of its own, it is bit-exact, reads every fragment
once and exactly the data ranges the one-shot plan reads (each once), and a flipped byte is still
refused naming its object."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError
from ckptio.manifest import ArrayItem
from ckptio.restoring import restore_checkpoint, select
from ckptio.restoring.batches import Batched, fragment_batches, fragment_cut, locator_gaps
from ckptio.store import CheckpointStore

HOSTS = 4
STEP = 3
ROW_CUTS = [0, 10, 30, 40, 64]  # uneven row blocks, one per host
BLOCK = 256  # small checksum blocks: every shard has several


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    return {
        "params/w": w,
        "params/w_bf16": (w / 3).astype(ml_dtypes.bfloat16),
        "opt/mu": rng.standard_normal((64, 48)).astype(np.float32),  # saved as column blocks
        "emb": rng.integers(-(1 << 30), 1 << 30, size=(6, 8, 5), dtype=np.int32),  # middle dimension
        "params/b": np.arange(48, dtype=np.float64) / 7,  # replicated: one host writes it
        "opt/nu": rng.standard_normal((64, 48)).astype(np.float32),  # the layout of params/w, other bytes
    }


#: How each array is saved: the dimension cut between the hosts and the cuts (None: replicated).
SAVED: dict[str, tuple[int, list[int]] | None] = {
    "params/w": (0, ROW_CUTS), "params/w_bf16": (0, ROW_CUTS), "opt/nu": (0, ROW_CUTS),
    "opt/mu": (1, [0, 12, 24, 36, 48]), "emb": (1, [0, 2, 4, 6, 8]), "params/b": None}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x, "c": y}`` -> ``{"a": {"b": x}, "c": y}``."""
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        a, _, b = name.partition("/")
        if b:
            out.setdefault(a, {})[b] = leaf
        else:
            out[a] = leaf
    return out


def host_state(rank: int) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, a in arrays().items():
        cut = SAVED[name]
        if cut is None:
            flat[name] = a
            continue
        d, at = cut
        box = tuple(slice(at[rank], at[rank + 1]) if i == d else slice(None) for i in range(a.ndim))
        flat[name] = ckptio.Sharded(a.shape, a.dtype, [(box, a[box])])
    return {**_nest(flat), "step": STEP}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A format-2 checkpoint of HOSTS fragments, with small checksum blocks (read-only below)."""
    root = tmp_path_factory.mktemp("batches") / "run"
    on_hosts(HOSTS, lambda rank, coord: ckptio.save(str(root), host_state(rank), step=STEP, coordinator=coord,
                                                   engine_config=ckptio.EngineConfig(block_size=BLOCK)).result())
    return root


def _piece(name: str, box: tuple[slice, ...]) -> ckptio.Sharded:
    a = arrays()[name]
    return ckptio.Sharded(a.shape, a.dtype, [(box, None)])


#: Targets that meet every fragment: name -> the box restored of each array.
TARGETS: dict[str, dict[str, tuple[slice, ...]]] = {
    "rows -> columns": {"params/w": (slice(None), slice(5, 17)), "params/w_bf16": (slice(None), slice(40, 48)),
                        "opt/mu": (slice(3, 9), slice(None)), "emb": (slice(1, 5), slice(None), slice(2, 3)),
                        "params/b": (slice(7, 30),), "opt/nu": (slice(None), slice(5, 17))},
    "whole": {n: tuple(slice(None) for _ in a.shape) for n, a in arrays().items()},
    "a straddling block": {"params/w": (slice(8, 33), slice(1, 47)), "opt/mu": (slice(20, 64), slice(11, 37)),
                           "opt/nu": (slice(8, 33), slice(1, 47))},
}


def _target(boxes: dict[str, tuple[slice, ...]]) -> dict[str, Any]:
    return _nest({name: _piece(name, box) for name, box in boxes.items()})


def _restore(root: Path, target: Any, budget: int, lists: list[str] | None = None
             ) -> tuple[Any, list[tuple[str, int, int]]]:
    """Restore ``target`` with ``budget``, and every (key, start, end) the backend read (and in
    ``lists``, every prefix it listed)."""
    store = CheckpointStore(str(root))
    reads: list[tuple[str, int, int]] = []
    read_into, list_ = store.backend.read_into, store.backend.list

    async def counting(key: str, rng: Any, buffers: Any) -> None:
        await read_into(key, rng, buffers)
        reads.append((key, rng.start, rng.end))

    async def listing(prefix: str, *args: Any, **kw: Any) -> Any:
        (lists if lists is not None else []).append(prefix)
        return await list_(prefix, *args, **kw)

    store.backend.read_into = counting  # type: ignore[method-assign]
    store.backend.list = listing  # type: ignore[method-assign]
    try:
        manifest = run_sync(store.read_manifest(str(STEP), shards=False))
        return restore_checkpoint(store, manifest, str(STEP), target, budget=budget), reads
    finally:
        run_sync(store.close())


def _leaf(tree: Any, name: str) -> Any:
    a, _, b = name.partition("/")
    return tree[a][b] if b else tree[a]


@pytest.mark.parametrize("case", list(TARGETS))
def test_a_tiny_budget_restores_bit_exact_and_reads_each_needed_range_once(saved: Path, case: str) -> None:
    boxes = TARGETS[case]
    store = CheckpointStore(str(saved))
    root = run_sync(store.read_manifest(str(STEP), shards=False))
    run_sync(store.close())
    sel = select(root, _target(boxes))
    assert fragment_cut(root, sel, 1) == [[f] for f in range(HOSTS)]  # the case really is batched...
    assert fragment_cut(root, sel, 1 << 30) == [list(range(HOSTS))]  # ...and a roomy budget plans at once

    lists: list[str] = []
    got, reads = _restore(saved, _target(boxes), budget=1, lists=lists)
    assert lists == [f"{STEP}/"]  # one listing checks every batch's objects
    _, once = _restore(saved, _target(boxes), budget=1 << 30)
    for name, box in boxes.items():
        [(_index, have)] = _leaf(got, name).pieces
        want = arrays()[name][box]
        assert have.dtype == want.dtype and have.shape == want.shape and have.tobytes() == want.tobytes(), name
    fragments = [r for r in reads if "fragment" in r[0]]
    assert len(fragments) == len({r[0] for r in fragments}) == len(root.fragments)  # each fragment read once
    data = sorted(r for r in reads if "fragment" not in r[0] and "manifest" not in r[0])
    for (k1, _a1, e1), (k2, s2, _e2) in zip(data, data[1:]):
        assert k1 != k2 or e1 <= s2, f"{k1}: bytes read twice"  # no stored byte read twice
    # Exactly the bytes the one-shot plan reads (the engine may split or merge reads differently).
    one_shot = sorted(r for r in once if "fragment" not in r[0] and "manifest" not in r[0])
    assert _bytes(data) == _bytes(one_shot)


def _bytes(reads: list[tuple[str, int, int]]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for key, a, b in reads:
        out.setdefault(key, set()).update(range(a, b))
    return out


def test_every_batch_holds_fragments_in_order_within_the_budget(saved: Path) -> None:
    store = CheckpointStore(str(saved))
    root = run_sync(store.read_manifest(str(STEP), shards=False))
    run_sync(store.close())
    names = [n for n, it in root.items.items() if isinstance(it, ArrayItem)]
    numbers = list(range(len(root.fragments or [])))
    assert fragment_batches(root, numbers, names, 1) == [[f] for f in numbers]
    assert fragment_batches(root, numbers, names, 1 << 30) == [numbers]
    assert fragment_batches(root, numbers, [], 1) == [numbers]  # no wanted rows: nothing held
    assert fragment_batches(root, [], names, 1) == [[]]  # no fragment: one empty batch (nothing to load)
    size = max(f.size for f in root.fragments or []) * 2 * 3  # about two fragments' rows
    cut = fragment_batches(root, numbers, names, size)
    assert [f for b in cut for f in b] == numbers and all(1 <= len(b) <= 2 for b in cut)


def test_a_flipped_byte_is_refused_naming_its_object(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    data = sorted(p for p in (root / str(STEP)).rglob("*") if p.is_file() and "manifest" not in p.name
                  and "fragment" not in p.name)
    victim = max(data, key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(IntegrityError, match=victim.name):
        _restore(root, _target(TARGETS["whole"]), budget=1)


def test_a_region_the_locators_do_not_cover_is_refused_before_any_read(saved: Path) -> None:
    store = CheckpointStore(str(saved))
    root = run_sync(store.read_manifest(str(STEP), shards=False))
    run_sync(store.close())
    item = root.items["params/w"]
    assert isinstance(item, ArrayItem) and item.locator is not None
    assert locator_gaps(item, (0, 0), (64, 48)) == 0 and locator_gaps(item, (5, 3), (20, 7)) == 0
    item.locator = item.locator[item.locator[:, 1] != 10]  # the root forgets host 1's rows 10..30
    assert locator_gaps(item, (0, 0), (64, 48)) == 20 * 48
    with pytest.raises(CheckpointNotFoundError, match="params/w"):
        Batched(root, select(root, _target({"params/w": (slice(None), slice(0, 4))})), "here")


def test_rows_a_fragment_lacks_are_refused_before_the_tree_is_built(saved: Path) -> None:
    store = CheckpointStore(str(saved))
    try:
        root = run_sync(store.read_manifest(str(STEP), shards=False))
        plan = Batched(root, select(root, _target({"params/w": (slice(None), slice(0, 4))})), "here")
        for reqs in plan.batches(store, str(STEP), [[0], [2, 3]]):  # fragment 1 (rows 10..30) never loaded
            run_sync(store.engine.read(reqs))
            del reqs
        with pytest.raises(ManifestError, match="params/w"):
            plan.finish()
    finally:
        run_sync(store.close())


def test_arrays_of_one_layout_asking_one_box_are_segmented_once_and_read_apart(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """params/w and opt/nu share their layout (and the box asked): their segments are found once
    (reshard.plan_regions) and each array still gets its own bytes, from its own extents."""
    from ckptio.restoring import reshard
    from ckptio.restoring.reshard import Region, plan_regions

    store = CheckpointStore(str(saved))
    try:
        m = run_sync(store.read_manifest(str(STEP)))
        calls = []
        real = reshard._add_segments
        monkeypatch.setattr(reshard, "_add_segments", lambda *a: (calls.append(a[1]), real(*a))[1])
        dests = {n: np.zeros((64, 12), np.float32) for n in ("params/w", "opt/nu")}
        reqs = plan_regions([(n, m.items[n], Region((0, 5), d)) for n, d in dests.items()], m.objects, m.block_size)
        assert calls == [0]  # the second array repeated the first one's segments
        run_sync(store.engine.read(reqs))
    finally:
        run_sync(store.close())
    for name, dest in dests.items():
        assert dest.tobytes() == arrays()[name][:, 5:17].tobytes(), name


def test_object_sizes_from_columns_are_those_of_the_records(saved: Path) -> None:
    """store.objects.manifest_object_sizes reads columnar items' extents as columns: the same
    needs as walking their shard records."""
    import dataclasses

    from ckptio.store.objects import manifest_object_sizes

    store = CheckpointStore(str(saved))
    try:
        m = run_sync(store.read_manifest(str(STEP)))
    finally:
        run_sync(store.close())
    assert all(it.table is not None for it in m.items.values() if isinstance(it, ArrayItem))
    records = dataclasses.replace(m, items={n: ArrayItem(it.dtype, it.shape, list(it.shards), it.scalar, it.origin)
                                           if isinstance(it, ArrayItem) else it for n, it in m.items.items()})
    assert all(it.table is None for it in records.items.values() if isinstance(it, ArrayItem))
    need = manifest_object_sizes(m)
    assert need == manifest_object_sizes(records) and len(need) == len(set(m.objects)) and all(need.values())


def test_a_short_object_is_refused_naming_it_before_its_batch_is_read(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(saved, root)
    data = [p for p in (root / str(STEP)).rglob("*") if p.is_file() and "manifest" not in p.name
            and "fragment" not in p.name]
    victim = max(data, key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 1)
    with pytest.raises(IntegrityError, match=f"{victim.name}.* holds"):
        _restore(root, _target(TARGETS["whole"]), budget=1)


def test_the_scale_bench_plans_as_the_restore_does_batched_or_not(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.scale's host plan goes through ckptio.restoring.batches where the restore would: the
    same bytes planned with one batch per fragment as at once."""
    import importlib
    import json

    from ckptio.bench import scale

    batches = importlib.import_module("ckptio.restoring.batches")
    (tmp_path / "1").mkdir()
    path = tmp_path / "summaries.json"
    path.write_text(json.dumps([scale._host_files(str(tmp_path), 8, 8, r) for r in range(8)]))
    got: list[dict[str, Any]] = []

    class Out:
        def put(self, x: dict[str, Any]) -> None:
            got.append(x)

    scale._commit(str(tmp_path), str(path), 8, Out())
    scale._plan(str(tmp_path), 4, 8, "resharded", Out())
    monkeypatch.setattr(batches, "METADATA_BUDGET", 1)
    scale._plan(str(tmp_path), 4, 8, "resharded", Out())
    at_once, batched = got[1], got[2]
    assert "batches" not in at_once and batched["batches"] == 8
    assert batched["storage_read"] == at_once["storage_read"] and batched["storage_needed"] == at_once["storage_needed"]
    assert batched["bytes_read"] == at_once["bytes_read"]  # each fragment read once either way
