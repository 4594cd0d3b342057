"""Per-extent checksum blocks (issue 32, part 3): a small shard is checksummed in small blocks of
its own, so a restore onto twice the hosts (each reading half a saved shard) or onto an odd split
reads about what it needs, bit-exact, with every byte still verified; old manifests still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.backends.wrappers import CountingBackend
from ckptio.engine import run_sync
from ckptio.engine.layout import MIN_BLOCK, extent_block
from ckptio.manifest import BLOCKS_VERSION, MANIFEST_NAME, formats, unseal
from ckptio.store import CheckpointStore

HOSTS = 8
ROWS_PER_HOST, COLS = 50, 1000  # a shard: 200,000 bytes of float32, far below a 1 MiB block
ROWS = HOSTS * ROWS_PER_HOST
NAMES = ("w", "mu")


def full(name: str) -> np.ndarray:
    return np.random.default_rng(sum(map(ord, name))).standard_normal((ROWS, COLS)).astype(np.float32)


def rows(lo: int, hi: int) -> tuple[slice, slice]:
    return (slice(lo, hi), slice(None))


def save_rows(url: str, hosts: int = HOSTS, cfg: ckptio.EngineConfig | None = None, step: int = 1,
              options: ckptio.SaveOptions | None = None) -> None:
    """``hosts`` hosts (threads) save row blocks of every array: format 2."""
    n = ROWS // hosts

    def body(rank: int, coord: Any) -> Any:
        ix = rows(rank * n, (rank + 1) * n)
        state = {name: ckptio.Sharded((ROWS, COLS), np.float32, [(ix, full(name)[ix])]) for name in NAMES}
        return ckptio.save(url, state, step=step, coordinator=coord, engine_config=cfg, save_options=options).result()

    on_hosts(hosts, body)


def restore_rows(url: str, lo: int, hi: int, step: int = 1) -> tuple[dict[str, Any], int]:
    """One target host's row block of every array; returns it and the data bytes it read."""
    counting = CountingBackend(ckptio.backends.open_backend(url))
    target = {name: ckptio.Sharded((ROWS, COLS), np.float32, [(rows(lo, hi), None)]) for name in NAMES}
    got = ckptio.restore(url, step=step, target=target, backend=counting)
    read = sum(r.length for k, r in counting.reads if "ckptio." not in k)  # not the manifest, not fragments
    return got, read


def check_split(url: str, bounds: list[int], most: float) -> float:
    """Restore every block ``bounds[i]:bounds[i+1]`` as a host of its own, bit-exact. Each reads at most
    ``most`` times its bytes, or (a block of a few rows) its bytes plus a checksum block at either end
    of each saved shard it meets; all together at most ``most`` times theirs. Returns the worst ratio."""
    worst, total_read, total_needed = 0.0, 0, 0
    for lo, hi in zip(bounds, bounds[1:]):
        got, read = restore_rows(url, lo, hi)
        for name in NAMES:
            assert got[name].pieces[0][1].tobytes() == full(name)[lo:hi].tobytes()
        needed = len(NAMES) * (hi - lo) * COLS * 4
        met = (hi - 1) // ROWS_PER_HOST - lo // ROWS_PER_HOST + 1
        worst = max(worst, read / needed)
        assert needed <= read <= max(most * needed, needed + len(NAMES) * met * 2 * MIN_BLOCK), (lo, hi, read, needed)
        total_read, total_needed = total_read + read, total_needed + needed
    assert total_read <= most * total_needed
    return worst


def root_doc(root: Path, step: int = 1) -> dict[str, Any]:
    return json.loads(unseal((root / str(step) / MANIFEST_NAME).read_bytes(), "root"))


def manifest(url: str, step: int = 1) -> Any:
    """The whole manifest (a format-2 root with every fragment loaded)."""
    return run_sync(CheckpointStore(url).read_manifest(str(step)))


# -- the rule -------------------------------------------------------------------------------------


def test_block_rule_small_shards_get_small_blocks_big_shards_and_small_whole_arrays_keep_theirs() -> None:
    mib = 1 << 20
    assert extent_block(200_000, False, mib) == MIN_BLOCK  # 48 blocks of 4 KiB
    assert extent_block(8 * mib, False, mib) == 256 << 10  # 32 blocks
    assert extent_block(32 * mib, False, mib) == 0 and extent_block(1 << 30, False, 4 * mib) == 0  # big: as before
    assert extent_block(4096, False, mib) == 0  # one block either way
    assert extent_block(200_000, True, mib) == 0  # a small whole array: read whole, one checksum
    assert extent_block(4 * mib, True, mib) == 128 << 10  # a large whole array may be read in part
    assert extent_block(200_000, False, 1024) == 0  # never above the configured block
    for size in (5000, 123_457, 3 * mib + 17, 31 * mib):
        b = extent_block(size, False, 64 * mib)
        assert b % MIN_BLOCK == 0 and (size // b >= 32 or b == MIN_BLOCK)


# -- N -> 2N and odd splits -----------------------------------------------------------------------


def test_n_to_2n_and_odd_splits_read_at_most_1_1x_bit_exact(tmp_path: Path) -> None:
    url = str(tmp_path)
    save_rows(url)
    doc = root_doc(tmp_path)
    assert doc["version"] >= BLOCKS_VERSION and "fragments" in doc
    half = ROWS_PER_HOST // 2
    check_split(url, list(range(0, ROWS + 1, half)), 1.1)  # 8 -> 16 hosts: half a saved shard each
    check_split(url, [0, 80, 160, 240, 320, 400], 1.1)  # 8 -> 5: blocks that cut saved shards anywhere
    check_split(url, [0, 7, 93, 211, 212, 399, 400], 1.1)  # ragged, down to one row


def test_without_per_extent_blocks_the_same_split_reads_about_2x(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """What the issue measured (1.9x): the old layout, one 1 MiB block per small shard, still reads."""
    monkeypatch.setattr(ckptio.engine.layout, "extent_block", lambda *a: 0)
    url = str(tmp_path)
    save_rows(url)
    doc = root_doc(tmp_path)
    # No extent of its own block: the version sectioned fragments need, not one for blocks.
    assert doc["version"] == formats.version_for(fragments=True, columns=True, heads=True)
    worst = check_split(url, [0, 25, 50], 2.01)
    assert worst > 1.9


def test_an_old_format_1_manifest_still_restores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckptio.engine.layout, "extent_block", lambda *a: 0)
    url = str(tmp_path)
    state = {name: full(name) for name in NAMES}
    ckptio.save(url, state, step=1).result()
    doc = root_doc(tmp_path)
    assert doc["version"] < BLOCKS_VERSION
    assert all(len(e) == 5 for it in doc["items"].values() if isinstance(it, dict) and it.get("kind") == "array"
               for s in it["shards"] for e in s["extents"])
    monkeypatch.undo()
    for lo, hi in ((0, 25), (25, 399), (399, 400)):  # partial reads of 1 MiB blocks, verified with them
        part, read = restore_rows(url, lo, hi)
        assert all(part[n].pieces[0][1].tobytes() == full(n)[lo:hi].tobytes() for n in NAMES) and read
    got = ckptio.restore(url, step=1)
    assert all(got[n].tobytes() == full(n).tobytes() for n in NAMES)


def test_an_older_reader_refuses_a_checkpoint_with_its_own_blocks(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path)
    save_rows(url, hosts=2)
    monkeypatch.setattr(formats, "VERSION", BLOCKS_VERSION - 1)  # play a ckptio from before format 6
    with pytest.raises(ckptio.errors.ManifestError, match=r"version \d+ is not supported"):
        ckptio.restore(url, step=1)


# -- integrity ------------------------------------------------------------------------------------


def _flip(root: Path, key: str, at: int) -> None:
    with open(root / key, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_flipped_byte_inside_a_small_block_is_caught_and_names_the_object(tmp_path: Path) -> None:
    url = str(tmp_path)
    save_rows(url, hosts=2)
    m = manifest(url)
    shard = next(s for s in m.items["w"].shards if s.offsets[0] == 0)
    (e,) = shard.extents
    assert e.block == extent_block(800_000, False, m.block_size) == 24 << 10  # 800 KB: 33 blocks
    assert len(e.crcs) == 33
    key = m.objects[e.object]
    _flip(tmp_path, key, e.offset + 3 * e.block + 5)  # inside the shard's 4th block
    target = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(rows(0, 40), None)])}
    with pytest.raises(ckptio.IntegrityError) as info:
        ckptio.restore(url, step=1, target=target)
    assert key in str(info.value) and "'w'" in str(info.value)
    # Rows that meet other blocks only: still restored, every byte verified.
    later = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(rows(40, ROWS), None)])}
    got = ckptio.restore(url, step=1, target=later)
    assert got["w"].pieces[0][1].tobytes() == full("w")[40:].tobytes()
