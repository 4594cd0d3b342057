"""Whole version-4 fragments taken a batch at once (issue 32, rows -> columns at 4096 hosts).

:meth:`FragmentLoader.add_batch` must gather exactly what :meth:`FragmentLoader.add` of each
fragment in turn gathers, and refuse exactly what it refuses, with the same error: for every
byte of a fragment's index and sections changed, with the root's checksums recomputed so that
the change passes every check the root makes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.manifest.codec.test_sections import STEP, _datas, _root_doc
from tests.manifest.test_fragments import full, save_on_hosts

import ckptio
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import fragments, seal
from ckptio.manifest.codec import split
from ckptio.system.checksum import crc32c


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wholes")
    save_on_hosts(str(root))
    return root


def _gathered(doc: dict[str, Any], datas: dict[str, bytes], names: set[str] | None, *, batch: bool) -> Any:
    """What a loader of every fragment of ``doc`` gathers (columns and objects), or the error it raises."""
    manifest = ckptio.manifest.Manifest.from_json(seal(doc), "root")
    refs = manifest.fragments
    by_number = {f: datas[r.key] for f, r in enumerate(refs)}
    loader = split.FragmentLoader(manifest, str(STEP), "root", complete=names is None, names=names, few=False,
                                  expect=len(refs))
    try:
        if batch:
            loader.add_batch(list(by_number), by_number)
        else:
            for f, data in by_number.items():
                loader.add(f, data)
    except (IntegrityError, ManifestError) as e:
        return type(e), str(e)
    cols = loader.gather.done()
    return ({k: (v.dtype.str, v.tolist()) if isinstance(v, np.ndarray) else v for k, v in cols.items()},
            list(loader.objects))


def _names(doc: dict[str, Any]) -> list[str]:
    return [n for n, it in doc["items"].items() if it["kind"] == "array"]


def test_a_batch_gathers_what_each_fragment_in_turn_gathers(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, datas = _root_doc(saved), _datas(saved)
    arrays = _names(doc)
    choices: list[set[str] | None] = [None, {arrays[0]}, set(arrays[::2]), {"params/w"}]
    want = [_gathered(doc, datas, names, batch=False) for names in choices]
    assert all(isinstance(w[0], dict) and len(w[0]["item"][1]) for w in want)

    def refuse(*_a: Any) -> None:
        raise AssertionError("the batch fell back to adding each fragment alone")

    monkeypatch.setattr(split.FragmentLoader, "add", refuse)  # the batch path really is taken
    for names, expected in zip(choices, want):
        assert _gathered(doc, datas, names, batch=True) == expected
    monkeypatch.setattr(split, "WHOLES", 2)  # in two batches of two
    for names, expected in zip(choices, want):
        assert _gathered(doc, datas, names, batch=True) == expected


def test_a_restore_of_every_array_is_bit_exact(saved: Path) -> None:
    got = ckptio.restore(saved, step=STEP)
    for n in ("w", "mu", "nu"):
        assert got["params"][n].tobytes() == full(n).tobytes()


@pytest.mark.parametrize(("flip", "f", "wholes"), [(0x01, 1, 32), (0x80, 1, 32), (0x01, 1, 2), (0x80, 3, 2)])
def test_every_changed_byte_of_the_index_and_sections_meets_the_same_answer(
        saved: Path, flip: int, f: int, wholes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(split, "WHOLES", wholes)  # 2: the changed fragment's batch and one clean batch
    doc0, datas = _root_doc(saved), _datas(saved)
    ref0 = doc0["fragments"][f]
    clean = datas[ref0["key"]]
    refused = kept = 0
    for at in range(ref0["head_size"], len(clean)):
        bad = bytearray(clean)
        bad[at] ^= flip
        doc = _root_doc(saved)
        doc["fragments"][f].update(crc32c=crc32c(bytes(bad)))  # the root's checks pass
        changed = {**datas, ref0["key"]: bytes(bad)}
        for names in (None, {"params/w"}):
            one_by_one = _gathered(doc, changed, names, batch=False)
            assert _gathered(doc, changed, names, batch=True) == one_by_one, at
            if isinstance(one_by_one[0], type):
                assert ref0["key"] in one_by_one[1]
                refused += 1
            else:
                kept += 1
    assert refused and kept  # both outcomes were met


def test_version_3_fragments_are_added_alone_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fragments, "FRAGMENT_VERSION", 3)
    save_on_hosts(str(tmp_path))
    monkeypatch.undo()
    doc, datas = _root_doc(tmp_path), _datas(tmp_path)
    assert all("head_size" not in f for f in doc["fragments"])
    for names in (None, {"params/w"}):
        got = _gathered(doc, datas, names, batch=True)
        assert isinstance(got[0], dict) and got == _gathered(doc, datas, names, batch=False)
    empty = split.FragmentLoader(ckptio.manifest.Manifest.from_json(seal(doc), "root"), str(STEP), "root",
                                 complete=False, names=None, few=False, expect=0)
    empty.add_batch([], {})
    assert empty.objects == []


def test_ranges_are_each_start_counted_up() -> None:
    """``_ranges`` (every batch's checksum and extent indices) against its definition, empty
    and single ranges included, in int64 and (the wholes' checksum indices) int32; negative
    counts are refused."""
    from ckptio.manifest.codec.columns import _ranges

    rng = np.random.default_rng(7)
    for _ in range(2000):
        n = int(rng.integers(0, 12))
        starts, counts = rng.integers(-3, 50, n), rng.integers(0, 4, n)
        want = [s + k for s, c in zip(starts.tolist(), counts.tolist()) for k in range(c)]
        got = _ranges(starts, counts)
        assert got.dtype == np.int64 and got.tolist() == want
        got = _ranges(starts, counts, np.int32)
        assert got.dtype == np.int32 and got.tolist() == want
    with pytest.raises(ValueError):
        _ranges(np.array([0, 5]), np.array([2, -1]))


def test_items_exactly_assigned_are_those_owned_whole() -> None:
    """``_exactly_assigned`` (every item sharing a locator asked at once) says yes exactly where
    an item's rows are its locator's rows in its order, and then ``_owned`` keeps them all; a
    replica row, a row of another fragment, or rows out of order send the item to ``_owned``."""
    from types import SimpleNamespace

    from ckptio.manifest.codec.columns import _exactly_assigned, _owned

    rng = np.random.default_rng(3)
    width = 2
    for _ in range(200):
        n = int(rng.integers(1, 6))
        loc = np.column_stack([np.arange(n), rng.integers(0, 9, (n, 2)), rng.integers(1, 5, (n, 2))])
        kinds = rng.choice(["exact", "replica", "other", "swapped"], size=int(rng.integers(1, 5)))
        items, rows_of = [], []
        for kind in kinds:
            rows = loc.copy()
            if kind == "replica":
                rows = np.concatenate([rows, rows[-1:]])
            elif kind == "other":
                rows[0, 0] = n  # a fragment not loaded
            elif kind == "swapped" and n > 1:
                rows = rows[::-1].copy()
            items.append(SimpleNamespace(locator=loc, shape=(10, 10)))
            rows_of.append(rows)
        bounds = np.concatenate([[0], np.cumsum([len(r) for r in rows_of])]).tolist()
        every = np.concatenate(rows_of)
        cols = {"frag": every[:, 0], "boxes": np.column_stack([every[:, 1:], np.full((len(every), 2), -1)]),
                "loaded": np.arange(n + 1), "hosts": np.arange(n + 1)}
        exact = _exactly_assigned(items, bounds, cols, width, {})  # type: ignore[arg-type]
        for i, rows in enumerate(rows_of):
            in_order = len(rows) == n and np.array_equal(rows, loc)
            assert exact[i] == in_order, (kinds[i], rows, loc)
            if exact[i]:
                owned = _owned(items[i], np.arange(bounds[i], bounds[i + 1]), cols, width, {})  # type: ignore[arg-type]
                assert owned.tolist() == list(range(bounds[i], bounds[i + 1]))
