"""The DCP Reader's read-once (ckptio/dcp/_readonce.py) in one process: hosts as threads, each
filling the regions its read items name by logical-box exchange. Bit-exactness, the storage bytes
the job reads, a box held twice, and a rank whose read items fail. Real processes through
``dcp.load``: tests/dcp/test_dcp_multiprocess.py and tests/restoring/test_readonce_mp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import ckptio  # noqa: E402
from ckptio.backends import open_backend  # noqa: E402
from ckptio.backends.wrappers import CountingBackend  # noqa: E402
from ckptio.dcp._readonce import exchange_regions  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402
from ckptio.errors import ManifestError  # noqa: E402
from ckptio.restoring.reshard import Region  # noqa: E402
from ckptio.store import CheckpointStore, StoreOptions  # noqa: E402

from tests.restoring.test_readonce import _Host, on_hosts  # noqa: E402

HOSTS = 4
ROWS, COLS = 64, 256  # float32: 64 KiB, saved as HOSTS row shards (each its own chunk)
W = np.random.default_rng(11).standard_normal((ROWS, COLS), dtype=np.float32)
EMB = np.random.default_rng(12).integers(0, 1 << 30, 5000, dtype=np.int64)


def _save(root: Path) -> None:
    rows = ROWS // HOSTS
    pieces = [((slice(i * rows, (i + 1) * rows), slice(None)), W[i * rows:(i + 1) * rows]) for i in range(HOSTS)]
    ckptio.save(str(root), {"w": ckptio.Sharded((ROWS, COLS), np.float32, pieces), "emb": EMB}, step=1).result()


def _column_wants(manifest: Any, rank: int) -> list[tuple[str, Any, Region]]:
    """What a DCP plan of ``w`` as column blocks asks: per saved row chunk, its rows of this rank's
    columns (one read item each); and ``emb`` whole (replicated)."""
    cols, rows = COLS // HOSTS, ROWS // HOSTS
    w = manifest.items["w"]
    wants = [("w", w, Region((i * rows, rank * cols), np.zeros((rows, cols), np.float32))) for i in range(HOSTS)]
    return wants + [("emb", manifest.items["emb"], Region((0,), np.zeros(EMB.shape, EMB.dtype)))]


def _run(root: Path, plan_of: Any) -> list[Any]:
    def body(rank: int, host: _Host) -> Any:
        counting = CountingBackend(open_backend(str(root)))
        store = CheckpointStore(StoreOptions(str(root), backend=counting))
        try:
            manifest = run_sync(store.read_manifest("1"))
            wants: list[Any] = []

            def plan() -> list[Any]:
                wants.extend(plan_of(manifest, rank))
                return wants

            restored = exchange_regions(store, manifest, "1", plan, host)
        finally:
            run_sync(store.close())
        return wants, restored, counting.bytes_read

    return on_hosts(HOSTS, body)


def _stored(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "1").iterdir())


def test_read_items_are_filled_bit_exact_reading_each_stored_byte_once(tmp_path: Path) -> None:
    _save(tmp_path)
    results = _run(tmp_path, _column_wants)
    cols, rows = COLS // HOSTS, ROWS // HOSTS
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        wants, restored, _read = r
        for i in range(HOSTS):
            got = wants[i][2].dest
            assert got.tobytes() == W[i * rows:(i + 1) * rows, rank * cols:(rank + 1) * cols].tobytes(), (rank, i)
        assert wants[-1][2].dest.tobytes() == EMB.tobytes()
        assert restored == W.nbytes // HOSTS + EMB.nbytes
    # Every rank wants emb whole and a column of every row shard: without the exchange, each
    # reads the checkpoint's data (the manifest is read by every rank: small).
    assert sum(r[2] for r in results) <= 1.1 * _stored(tmp_path)


def test_a_box_asked_twice_and_a_box_of_nothing_are_filled(tmp_path: Path) -> None:
    """Two read items of one rank may name one saved box (two destinations); an empty one reads nothing."""
    _save(tmp_path)

    def plan(manifest: Any, rank: int) -> list[Any]:
        w = manifest.items["w"]
        return [("w", w, Region((0, 0), np.zeros((ROWS, 8), np.float32))),
                ("w", w, Region((0, 0), np.zeros((ROWS, 8), np.float32))),
                ("w", w, Region((3, 5), np.zeros((0, 4), np.float32)))]

    for r in _run(tmp_path, plan):
        assert not isinstance(r, BaseException), r
        assert all(w[2].dest.tobytes() == W[:, :8].tobytes() for w in r[0][:2])


def test_a_rank_whose_read_items_fail_fails_every_rank_naming_it(tmp_path: Path) -> None:
    _save(tmp_path)

    def plan(manifest: Any, rank: int) -> list[Any]:
        if rank == 2:
            raise ManifestError("the load plan asks for chunk [99, 0] of 'w', which the checkpoint does not hold")
        return _column_wants(manifest, rank)

    results = _run(tmp_path, plan)
    assert all(isinstance(r, ManifestError) for r in results), results
    assert all("host 2" in str(r) and "[99, 0]" in str(r) for r in results), results


def test_read_items_of_the_saved_layout_are_read_by_each_rank_itself(tmp_path: Path) -> None:
    """Each rank asking for the chunk it saved (DCP's same-layout load): no two ranks share a
    byte, so each reads its own (boxroute.apart) and the job reads the data once."""
    _save(tmp_path)
    rows = ROWS // HOSTS

    def plan(manifest: Any, rank: int) -> list[Any]:
        return [("w", manifest.items["w"], Region((rank * rows, 0), np.zeros((rows, COLS), np.float32)))]

    results = _run(tmp_path, plan)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert r[0][0][2].dest.tobytes() == W[rank * rows:(rank + 1) * rows].tobytes()
    assert sum(r[2] for r in results) <= 1.1 * _stored(tmp_path)
