"""Format 9 (ckptio.manifest.refs): a manifest that references an older step's objects.

Older readers refuse it plainly; readers of older formats are unchanged; a key outside the step
is accepted only inside a declared, older base; a restore follows references bit-exact.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio.engine import run_sync
from ckptio.errors import ManifestError
from ckptio.manifest import Manifest, formats
from ckptio.manifest.model import ArrayItem
from ckptio.manifest.names import new_id
from ckptio.saving.incremental.reuse import digest_of, rebase, unchanged
from ckptio.store import CheckpointStore
from ckptio.store.manifests import check_binding

N = 1 << 19  # float32: 2 MiB an array, above the pack size: its own object


def states() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two steps' states: ``frozen`` unchanged between them, ``moving`` changed."""
    rng = np.random.default_rng(7)
    frozen = rng.standard_normal(N).astype(np.float32)
    one = {"frozen": frozen, "moving": rng.standard_normal(N).astype(np.float32), "step": 1}
    two = {"frozen": frozen.copy(), "moving": rng.standard_normal(N).astype(np.float32), "step": 2}
    return one, two


def with_digests(m: Manifest, state: dict[str, Any]) -> Manifest:
    """``m`` with the sha256 of each whole-array shard (what an incremental save records)."""
    digests = {}
    for name, item in m.items.items():
        if isinstance(item, ArrayItem):
            digests[name] = {(tuple(s.offsets), tuple(s.shape)): digest_of(np.ascontiguousarray(state[name]).data)
                             for s in item.shards}
    return dataclasses.replace(m, digests=digests)


def planned(root: str) -> tuple[CheckpointStore, Manifest, Manifest, dict[str, Any]]:
    """Steps 1 and 2 saved in full; the manifest of a step 3 that holds step 2's state but writes
    nothing (``frozen`` from step 1's object, ``moving`` from step 2's), not committed; with
    step 1's manifest, and step 2's state."""
    one, two = states()
    ckptio.save(root, one, step=1).result()
    ckptio.save(root, two, step=2).result()
    store = CheckpointStore(root)
    m1 = with_digests(run_sync(store.read_manifest("1")), one)
    m2 = with_digests(run_sync(store.read_manifest("2")), two)
    reuse = unchanged(m2, m1, {(n, b): d for n, rows in m2.digests.items() for b, d in rows.items()})
    assert reuse == {("frozen", ((0,), (N,)))}  # the crcs and digests tell the changed item apart
    m3 = dataclasses.replace(m2, step=3, checkpoint_id=new_id(), fence=None,
                             bases={"2": m2.checkpoint_id})
    return store, rebase(m3, m1, "1", reuse), m1, two


def referencing(root: Path) -> tuple[CheckpointStore, Manifest, dict[str, Any]]:
    """:func:`planned`'s step 3, pinned and committed as an incremental save would."""
    store, m3, _m1, two = planned(str(root))
    for base, cid in m3.bases.items():
        assert run_sync(store.deletion.pins.pin(base, "3", m3.checkpoint_id, cid))
    run_sync(store.commit("3", m3))
    return store, m3, two


def test_a_referencing_manifest_round_trips_as_version_9(tmp_path: Path) -> None:
    _store, m3, _two = referencing(tmp_path)
    doc = m3.to_doc()
    assert doc["version"] == formats.REFS_VERSION == 9
    assert doc["bases"] == {"1": m3.bases["1"], "2": m3.bases["2"]}
    back = Manifest.from_json(m3.to_json(), "test")
    assert back.bases == m3.bases and back.digests == m3.digests and back.objects == m3.objects
    assert {k.split("/")[0] for k in back.objects} == {"1", "2"}  # nothing of its own


def test_restore_follows_references_bit_exact(tmp_path: Path) -> None:
    _store, _m3, two = referencing(tmp_path)
    got = ckptio.restore(str(tmp_path), step=3)
    for name in ("frozen", "moving"):
        assert got[name].tobytes() == two[name].tobytes()
    assert ckptio.restore(str(tmp_path), step=None)["moving"].tobytes() == two["moving"].tobytes()


def test_an_older_reader_refuses_version_9_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store, m3, _two = referencing(tmp_path)
    monkeypatch.setattr(formats, "VERSION", 8)
    with pytest.raises(ManifestError, match=r"manifest version 9 is not supported by this ckptio \(reads <= 8\)"):
        Manifest.from_json(m3.to_json(), "test")


def test_a_plain_save_still_writes_its_old_version(tmp_path: Path) -> None:
    one, _two = states()
    ckptio.save(str(tmp_path), one, step=1).result()
    m = run_sync(CheckpointStore(str(tmp_path)).read_manifest("1"))
    assert m.bases is None and m.digests is None
    assert m.to_doc()["version"] < formats.REFS_VERSION


def test_binding_accepts_foreign_keys_only_in_a_declared_older_base(tmp_path: Path) -> None:
    _store, m3, _two = referencing(tmp_path)
    check_binding(m3, "3", "test")
    undeclared = dataclasses.replace(m3, bases={"2": m3.bases["2"]})
    with pytest.raises(ManifestError, match="lies outside this checkpoint's step"):
        check_binding(undeclared, "3", "test")
    with pytest.raises(ManifestError, match="lies outside this checkpoint's step"):
        check_binding(dataclasses.replace(m3, bases=None), "3", "test")
    doc = m3.to_doc()
    doc["bases"]["5"] = doc["bases"].pop("2")
    with pytest.raises(ManifestError, match="base step 5 is not older"):
        Manifest.from_doc(doc, "test")
    doc = m3.to_doc()
    doc["version"] = 8
    with pytest.raises(ManifestError, match="need format 9"):
        Manifest.from_doc(doc, "test")


@pytest.mark.parametrize("bad", [{"1": "xyz"}, {"x": "0123456789ab"}, ["1"]])
def test_malformed_bases_are_refused_naming_them(tmp_path: Path, bad: Any) -> None:
    _store, m3, _two = referencing(tmp_path)
    doc = m3.to_doc()
    doc["bases"] = bad
    with pytest.raises(ManifestError, match="'bases'"):
        Manifest.from_doc(doc, "test")


def test_rebase_refuses_a_shard_the_base_holds_otherwise(tmp_path: Path) -> None:
    store, _m3, two = referencing(tmp_path)
    m1 = with_digests(run_sync(store.read_manifest("1")), two)
    m2 = run_sync(store.read_manifest("2"))
    with pytest.raises(ValueError, match="'moving'.*no shard with the same record"):
        rebase(m2, m1, "1", [("moving", ((0,), (N,)))])
