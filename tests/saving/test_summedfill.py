"""The staging copy that checksums as it copies (ckptio.system.checksum.copy_summed, ckptio.saving.summedfill): the
sums are those of the copied bytes in each extent's own blocks, every manifest row matches the bytes on
disk whichever writer wrote them, and the engine's own pass runs only where staging could not sum."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio import SaveOptions
from ckptio.engine import core as engine_mod
from ckptio.saving import fillers
from ckptio.saving.summedfill import wanted
from ckptio.system.checksum import FUSED_CHUNK, block_crcs, copy_summed


@pytest.mark.parametrize("block", [4096, 12 << 10, 256 << 10, FUSED_CHUNK, 3 * FUSED_CHUNK])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 5 * FUSED_CHUNK + 777])
def test_copy_summed_copies_and_sums_the_copy_in_its_blocks(block: int, nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    sums = copy_summed(memoryview(dst), memoryview(src), block)
    assert dst.tobytes() == src.tobytes()
    assert sums == block_crcs(memoryview(dst), block)


def test_copy_summed_refuses_buffers_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="copy of 8 bytes into a buffer of 4"):
        copy_summed(memoryview(bytearray(4)), memoryview(bytes(8)), 4096)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "aligned": rng.standard_normal(1 << 20, dtype=np.float32),  # 4 MiB: whole blocks
        "ragged": rng.standard_normal((1 << 18) + 37, dtype=np.float32),  # a short last block
        "big": rng.standard_normal(5 << 20, dtype=np.float32),  # 20 MiB: split across objects
        "strided": np.arange(400_000, dtype=np.float64)[::2],  # not a plain copy: the engine sums it
        "small": np.arange(100, dtype=np.int32),  # packed with others: the engine sums its pack
        "small2": np.ones(7, np.float16),
        "matrix": rng.standard_normal((300, 1000)).astype(np.float32),
    }


def _rows(step_dir: Path) -> list[tuple[str, list[Any], int]]:
    """Every extent row of a committed manifest: (object key, [offset, length, crcs, ...], block size)."""
    doc = json.loads((step_dir / "ckptio.manifest.json").read_text())["manifest"]
    out = []
    for item in doc["items"].values():
        for shard in item.get("shards", []) if isinstance(item, dict) else []:
            for e in shard["extents"]:
                out.append((doc["objects"][e[0]], e[1:], e[5] if len(e) > 5 else doc["block_size"]))
    return out


@pytest.mark.parametrize("cores", [1, 16])
@pytest.mark.parametrize("writer", ["thread", "sidecar"])
def test_every_manifest_row_is_the_checksum_of_the_bytes_on_disk(tmp_path: Path, writer: str, cores: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fillers, "usable_cores", lambda: cores)
    state = _state()
    opts = {"object_size": 8 << 20}  # "big" spans three objects
    ckptio.save(tmp_path, state, step=1, save_options=SaveOptions(writer=writer), backend_options=opts).result()
    rows = _rows(tmp_path / "1")
    assert len({key for key, _e, _b in rows}) >= 3
    for key, (offset, _shard_offset, length, crcs, *_), block in rows:
        data = (tmp_path / "1" / key.rsplit("/", 1)[-1]).read_bytes()[offset : offset + length]
        assert crcs == block_crcs(memoryview(data), block), key
    out = ckptio.restore(tmp_path, 1)  # every read verified against those rows
    for k, v in state.items():
        assert out[k].tobytes() == np.ascontiguousarray(v).tobytes(), k


@pytest.fixture
def no_spare_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a 2-core host, or under a training thread pinned to its core: the copy sums as it goes."""
    monkeypatch.setattr(fillers, "usable_cores", lambda: 1)


@pytest.fixture
def summed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every extent the engine checksums itself."""
    out: list[int] = []
    real = engine_mod.block_crcs

    def spy(view: memoryview, block: int) -> list[int]:
        out.append(view.nbytes)
        return real(view, block)

    monkeypatch.setattr(engine_mod, "block_crcs", spy)
    return out


def test_the_engine_sums_only_what_staging_could_not(tmp_path: Path, no_spare_core: None,
                                                     summed: list[int]) -> None:
    state = _state()
    ckptio.save(tmp_path, state, step=1, save_options=SaveOptions(writer="thread")).result()
    assert sorted(summed) == [state["strided"].nbytes]  # the plain copies came with their sums
    summed.clear()
    ckptio.save(tmp_path, state, step=2, save_options=SaveOptions(writer="thread"), copy=False).result()
    unpacked = [v.nbytes for k, v in state.items() if k not in ("small", "small2")]
    assert sorted(summed) == sorted(unpacked)  # no copy: the engine sums every extent


def test_with_a_core_to_spare_the_stall_is_the_copy_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         summed: list[int]) -> None:
    """A host with idle cores: the engine checksums later, beside the step, not inside its stall."""
    monkeypatch.setattr(fillers, "usable_cores", lambda: 16)
    state = _state()
    ckptio.save(tmp_path, state, step=1, save_options=SaveOptions(writer="thread")).result()
    assert sorted(summed) == sorted(v.nbytes for k, v in state.items() if k not in ("small", "small2"))
    assert wanted(4) is False and wanted(16) is True
