"""Fragment version 4 (issue 32): a head, an index and one section per array, read by range.

A reader wanting few arrays reads each fragment's head and its arrays' sections only; one
wanting all reads whole fragments; every head and section is checked, so a flipped byte or a
lying head is refused naming the fragment; v3 fragments (the previous writer) still restore; a
reader that predates format 10 refuses it by number."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.manifest.test_fragments import COLS, ROWS, full, host_state, save_on_hosts

import ckptio
from ckptio.backends.wrappers import WrapperBackend
from ckptio.engine import run_sync
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, formats, fragments, seal, unseal
from ckptio.manifest.codec import sections
from ckptio.manifest.lazy import with_fragments
from ckptio.store import CheckpointStore
from ckptio.system.checksum import crc32c

STEP = 3


class Ranges(WrapperBackend):
    """Records every read: (key, start, end)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int, int]] = []

    async def read_into(self, key: str, rng: Any, buffers: Any) -> None:
        self.reads.append((key, rng.start, rng.end))
        await super().read_into(key, rng, buffers)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4")
    save_on_hosts(str(root))
    return root


def _root_doc(root: Path) -> dict[str, Any]:
    return json.loads(unseal((root / str(STEP) / MANIFEST_NAME).read_bytes(), "root"))


def _column_block(name: str = "w") -> dict[str, Any]:
    return {"params": {name: ckptio.Sharded((ROWS, COLS), np.float32, [((slice(None), slice(0, 16)), None)])}}


def test_writers_write_v4_fragments_and_a_format_10_root(saved: Path) -> None:
    doc = _root_doc(saved)
    assert doc["version"] == formats.HEADS_VERSION
    for ref in doc["fragments"]:
        data = (saved / ref["key"]).read_bytes()
        assert data.startswith(sections.MAGIC) and ref["size"] == len(data)
        assert ref["head_crc32c"] == crc32c(data[: ref["head_size"]])


def test_one_array_reads_heads_and_its_sections_only(saved: Path) -> None:
    refs = {f["key"]: f for f in _root_doc(saved)["fragments"]}
    backend = Ranges(ckptio.backends.open_backend(str(saved)))
    got = ckptio.restore(saved, step=STEP, target=_column_block(), backend=backend)
    assert got["params"]["w"].pieces[0][1].tobytes() == np.ascontiguousarray(full("w")[:, :16]).tobytes()
    frag_reads = [r for r in backend.reads if r[0] in refs]
    assert {r[0] for r in frag_reads} == set(refs)  # a column block meets every host's rows
    for key, ref in refs.items():
        mine = [r for r in frag_reads if r[0] == key]
        assert len(mine) == 2 and mine[0][1] == 0 and mine[0][2] >= ref["head_size"]  # head (+ entries), section
        assert sum(e - s for _k, s, e in mine) < ref["size"] / 2


def test_a_reader_wanting_every_array_reads_whole_fragments(saved: Path) -> None:
    refs = {f["key"]: f for f in _root_doc(saved)["fragments"]}
    backend = Ranges(ckptio.backends.open_backend(str(saved)))
    got = ckptio.restore(saved, step=STEP, backend=backend)
    assert got["params"]["nu"].tobytes() == full("nu").tobytes()
    assert sorted((k, s, e) for k, s, e in backend.reads if k in refs) == \
        sorted((k, 0, ref["size"]) for k, ref in refs.items())


def _load(root: Path, datas: dict[str, bytes], names: set[str] | None, *, ranged: bool,
          doc: dict[str, Any] | None = None) -> Any:
    """The root of ``root`` (or ``doc``, sealed) with fragments ``datas`` (key -> bytes) loaded
    for items ``names``, whole or by range."""
    where = "root"
    data = seal(doc) if doc is not None else (root / str(STEP) / MANIFEST_NAME).read_bytes()
    manifest = ckptio.manifest.Manifest.from_json(data, where)
    refs = manifest.fragments

    async def fetch(numbers: list[int]) -> dict[int, bytes]:
        return {f: datas[refs[f].key] for f in numbers}

    async def fetch_ranges(asked: list[tuple[int, int, int]]) -> list[bytes]:
        out = []
        for f, a, b in asked:
            blob = datas[refs[f].key]
            if b > len(blob):
                raise IntegrityError(f"{refs[f].key} is short", key=refs[f].key)
            out.append(blob[a:b])
        return out

    return run_sync(with_fragments(manifest, list(range(len(refs))), fetch, str(STEP), where,
                                   names=names, fetch_ranges=fetch_ranges if ranged else None))


def _datas(root: Path) -> dict[str, bytes]:
    return {f["key"]: (root / f["key"]).read_bytes() for f in _root_doc(root)["fragments"]}


def _tables(m: Any, names: set[str]) -> dict[str, list[Any]]:
    return {n: sorted((tuple(s.offsets), tuple(s.shape), [(m.objects[e.object], e.offset, e.shard_offset, e.length,
                                                            tuple(e.crcs), e.block) for e in s.extents])
                      for s in m.items[n].shards) for n in names}


def test_every_flipped_byte_of_a_fragment_is_refused_naming_it_or_left_unread(saved: Path) -> None:
    datas = _datas(saved)
    key = _root_doc(saved)["fragments"][1]["key"]
    want = {"params/w"}
    clean = _tables(_load(saved, datas, want, ranged=True), want)
    assert clean == _tables(_load(saved, datas, None, ranged=False), want)
    refused_ranged = 0
    for at in range(len(datas[key])):
        bad = bytearray(datas[key])
        bad[at] ^= 0x10
        flipped = {**datas, key: bytes(bad)}
        with pytest.raises((IntegrityError, ManifestError), match=key):
            _load(saved, flipped, None, ranged=False)
        try:
            got = _load(saved, flipped, want, ranged=True)
        except (IntegrityError, ManifestError) as e:
            assert key in str(e)
            refused_ranged += 1
        else:  # the byte lies in a section this reader did not read
            assert _tables(got, want) == clean
    assert refused_ranged >= sections.MAGIC.__len__() + 32


def _relabelled(root: Path, datas: dict[str, bytes], f: int, change: Callable[[bytearray, int, int], None], i: int
                ) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Fragment ``f`` changed by ``change(data, head_size, i)`` (``i``: the number of the item read)
    and the root's checksums of it recomputed: the head lies, and every check the root makes passes."""
    doc = _root_doc(root)
    ref = doc["fragments"][f]
    data = bytearray(datas[ref["key"]])
    change(data, ref["head_size"], i)
    ref.update(size=len(data), crc32c=crc32c(bytes(data)), head_crc32c=crc32c(bytes(data[: ref["head_size"]])))
    return {**datas, ref["key"]: bytes(data)}, doc


def _swap_entries(data: bytearray, head_size: int, i: int) -> None:
    """Item ``i``'s index entry names the next item's section (with its right checksum), and back."""
    a, b = head_size + 16 * i, head_size + 16 * (i + 1)
    data[a : a + 16], data[b : b + 16] = data[b : b + 16], data[a : a + 16]


def _bad_crc(data: bytearray, head_size: int, i: int) -> None:
    data[head_size + 16 * i + 12] ^= 1  # item i's entry's crc32c


def _section_length(data: bytearray, head_size: int, i: int) -> None:
    data[head_size + 16 * i + 8] += 8  # item i's section 8 bytes longer than it is


def _section_offset(data: bytearray, head_size: int, i: int) -> None:
    data[head_size + 16 * i] += 8  # item i's section 8 bytes further on


def _head_field(offset: int) -> Callable[[bytearray, int, int], None]:
    def change(data: bytearray, head_size: int, i: int) -> None:
        data[len(sections.MAGIC) + offset] ^= 1
    return change


def _object_key(data: bytearray, head_size: int, i: int) -> None:
    text = bytes(data[len(sections.MAGIC) + 32 : head_size]).rstrip(b"\0")
    data[len(sections.MAGIC) + 32 : len(sections.MAGIC) + 32 + len(text)] = b"9" + text[1:]  # another step's


LIES = {"entries swapped": _swap_entries, "entry crc": _bad_crc, "entry length": _section_length,
        "entry offset": _section_offset, "step": _head_field(0), "width": _head_field(8),
        "item count": _head_field(12), "names digest": _head_field(20), "object key": _object_key}


@pytest.mark.parametrize("lie", LIES)
@pytest.mark.parametrize("ranged", [True, False], ids=["ranged", "whole"])
def test_a_lying_head_is_refused_naming_the_fragment(saved: Path, lie: str, ranged: bool) -> None:
    datas = _datas(saved)
    arrays = [n for n, it in _root_doc(saved)["items"].items() if it["kind"] == "array"]
    i = arrays.index("params/w")  # a host-sharded array: every fragment has its section
    lying, doc = _relabelled(saved, datas, 2, LIES[lie], i)
    key = doc["fragments"][2]["key"]
    if lie == "entry crc" and not ranged:
        # A whole reader checks the object's bytes by its crc32c (they are intact here) and uses
        # no section's own: it reads the shards as written. A ranged reader refuses them (above).
        names = {"params/w"}
        assert _tables(_load(saved, lying, None, ranged=False, doc=doc), names) == \
            _tables(_load(saved, datas, None, ranged=False), names)
        return
    with pytest.raises((IntegrityError, ManifestError), match=key):
        _load(saved, lying, {"params/w"} if ranged else None, ranged=ranged, doc=doc)


def test_v3_fragments_written_by_the_previous_writer_still_restore(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fragments, "FRAGMENT_VERSION", 3)
    save_on_hosts(str(tmp_path))
    monkeypatch.undo()
    doc = _root_doc(tmp_path)
    assert doc["version"] == formats.COLUMNS_VERSION and all("head_size" not in f for f in doc["fragments"])
    assert all((tmp_path / f["key"]).read_bytes().startswith(b'{"crc32c"') for f in doc["fragments"])
    got = ckptio.restore(tmp_path, step=STEP)
    for n in ("w", "mu", "nu"):
        assert got["params"][n].tobytes() == full(n).tobytes()
    one = ckptio.restore(tmp_path, step=STEP, target=_column_block("mu"))
    assert one["params"]["mu"].pieces[0][1].tobytes() == np.ascontiguousarray(full("mu")[:, :16]).tobytes()


def test_a_reader_that_predates_format_10_refuses_it_by_number(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(formats, "VERSION", formats.REFS_VERSION)
    with pytest.raises(ManifestError, match="version 10 is not supported"):
        run_sync(CheckpointStore(saved).read_manifest(str(STEP), shards=False))


def test_a_head_in_an_older_root_is_refused(saved: Path) -> None:
    doc = _root_doc(saved)
    doc["version"] = formats.COLUMNS_VERSION
    with pytest.raises(ManifestError, match="has a head, which needs format 10"):
        ckptio.manifest.Manifest.from_json(seal(doc), "root")


def test_a_fragment_shorter_than_its_root_says_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "r"
    save_on_hosts(str(root))
    key = _root_doc(root)["fragments"][1]["key"]
    (root / key).write_bytes((root / key).read_bytes()[:100])
    with pytest.raises(IntegrityError, match=key):
        ckptio.restore(root, step=STEP, target=_column_block())
    with pytest.raises(IntegrityError, match=key):
        ckptio.restore(root, step=STEP)


def test_a_copy_keeps_v4_fragments_readable(saved: Path, tmp_path: Path) -> None:
    shutil.copytree(saved, tmp_path / "c")
    got = ckptio.restore(tmp_path / "c", step=STEP, target=_column_block("nu"))
    assert got["params"]["nu"].pieces[0][1].tobytes() == np.ascontiguousarray(full("nu")[:, :16]).tobytes()
    assert host_state(0)["step"] == ckptio.restore(tmp_path / "c", step=STEP)["step"]


@pytest.mark.gcs
def test_on_gcs_one_array_is_read_by_ranged_gets(gcs_emulator_env: str, tmp_path: Path) -> None:
    from tests.conftest import GCS_TEST_BUCKET
    from fake_gcs import unique_prefix

    from ckptio.backends.wrappers import CountingBackend

    url = f"gs://{GCS_TEST_BUCKET}/{unique_prefix(tmp_path)}"
    save_on_hosts(url)
    backend = CountingBackend(ckptio.backends.open_backend(url))
    got = ckptio.restore(url, step=STEP, target=_column_block("mu"), backend=backend)
    assert got["params"]["mu"].pieces[0][1].tobytes() == np.ascontiguousarray(full("mu")[:, :16]).tobytes()
    refs = {f.key: f for f in run_sync(CheckpointStore(url).read_manifest(str(STEP), shards=False)).fragments}
    frag_reads = [(k, r) for k, r in backend.reads if k.split("/", 1)[-1] in refs or k in refs]
    assert len(frag_reads) == 2 * len(refs)  # per fragment: its head (and index entry), then one section
    assert all(r.length < refs[k if k in refs else k.split("/", 1)[-1]].size / 2 for k, r in frag_reads)
    assert ckptio.restore(url, step=STEP)["params"]["w"].tobytes() == full("w").tobytes()


def test_a_fragment_renamed_to_other_object_keys_keeps_every_section() -> None:
    """with_objects (a durable copy under another naming): the new head names the new keys, its index
    moves with it, and every section reads back the same, whole or by range, each still checked."""
    shards = [{"offsets": [0, 4 * k], "shape": [4, 4], "extents": [[k, 64 * k, 0, 64, [7 + k]]]} for k in range(3)]
    items = [("a", shards[:2]), ("empty", []), ("b", shards[2:])]
    data, size = sections.encode_sections(STEP, ["s/o0", "s/o1", "s/o2"], items)
    head = sections.parse_head(data, size, crc32c(data[:size]), "f", "f")
    longer = ["s/ab/cdef/" + "x" * 40 + str(k) for k in range(3)]
    for keys in (longer, ["a", "b", "c"]):
        out = sections.with_objects(data, head, keys, "f")
        new_size = sections.head_size_of(out)
        assert new_size is not None
        got = sections.parse_head(out, new_size, crc32c(out[:new_size]), "f", "f")
        assert got.objects == keys and (got.step, got.width, got.items, got.digest) == \
            (head.step, head.width, head.items, head.digest)
        before, after = sections.take_whole(data, head, None, "f"), sections.take_whole(out, got, None, "f")
        assert list(before[0]) == list(after[0]) == [0, 2]
        for x, y in zip(before[2], after[2]):
            assert np.array_equal(x, y)
        lo, hi = sections.index_range(got.size, 0, got.items - 1)
        index = sections.parse_index(out[lo:hi], 0, got, len(out), "f")
        parts = {i: out[int(index[i, 0]): int(index[i, 0] + index[i, 1])] for i in (0, 2)}
        assert sections.take_sections(parts, index, 0, got, "f", "f")[1] == [2, 1]
    with pytest.raises(ManifestError, match="2 object keys"):
        sections.with_objects(data, head, ["a", "b"], "f")
