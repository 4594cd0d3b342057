"""The DCP Reader on a format-2 checkpoint (a root + a fragment per saving host) reads the root and
only the fragments holding the chunks its read items name (#32): DCP's Metadata comes from the
root's locators, a plain read loads the fragments of its chunks, and nothing else is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hosts import on_hosts
from tests.dcp.test_dcp import _Planner, _quiet, _read  # noqa: F401 -- _quiet: an autouse fixture
from torch.distributed.checkpoint import LoadPlan

import ckptio
from ckptio.backends import open_backend
from ckptio.backends.wrappers import CountingBackend
from ckptio.dcp import Reader
from ckptio.errors import ManifestError

HOSTS, STEP, ROWS, COLS = 4, 3, 64, 48


def full() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {"w": rng.standard_normal((ROWS, COLS)).astype(np.float32), "b": np.arange(COLS, dtype=np.float64) / 7}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Step STEP saved by HOSTS hosts: ``w`` as one row block per host, ``b`` whole (host 0 writes it)."""
    root = tmp_path_factory.mktemp("dcpfrag") / "run"
    arrays, rows = full(), ROWS // HOSTS

    def state(rank: int) -> dict[str, object]:
        box = (slice(rank * rows, (rank + 1) * rows), slice(None))
        return {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(box, arrays["w"][box])]), "b": arrays["b"]}

    on_hosts(HOSTS, lambda rank, coord: ckptio.save(str(root), state(rank), step=STEP, coordinator=coord).result())
    return root


def counted(root: Path) -> tuple[Reader, CountingBackend]:
    reader = Reader(str(root), step=STEP)
    counting = CountingBackend(open_backend(str(root)))
    reader._options = dataclasses.replace(reader._options, backend=counting)
    return reader, counting


def fragments_read(counting: CountingBackend) -> list[str]:
    return sorted(k for k, _r in counting.reads if "fragment" in k.rsplit("/", 1)[-1])


def test_the_metadata_reads_the_root_alone_and_names_every_chunk(saved: Path) -> None:
    reader, counting = counted(saved)
    md = reader.read_metadata()
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks)
    rows = ROWS // HOSTS
    assert chunks == [((h * rows, 0), (rows, COLS)) for h in range(HOSTS)]
    assert [tuple(c.sizes) for c in md.state_dict_metadata["b"].chunks] == [(COLS,)]
    assert counting.reads and fragments_read(counting) == []


def test_a_plain_read_loads_only_the_fragment_of_its_chunk_bit_exact(saved: Path) -> None:
    reader, counting = counted(saved)
    reader.read_metadata()
    rows = ROWS // HOSTS
    tgt = torch.empty(3, 5)
    reader.read_data(LoadPlan([_read("w", (2, 7), (3, 5), "x", chunk=(2 * rows, 0))]), _Planner({"x": tgt})).wait()
    assert tgt.numpy().tobytes() == full()["w"][2 * rows + 2 : 2 * rows + 5, 7:12].tobytes()
    assert len(fragments_read(counting)) == 1
    assert len(set(fragments_read(counting))) == len(fragments_read(counting))


def test_dcp_load_of_everything_reads_each_fragment_once_bit_exact(saved: Path) -> None:
    reader, counting = counted(saved)
    sd = {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS, dtype=torch.float64)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    want = full()
    assert sd["w"].numpy().tobytes() == want["w"].tobytes() and sd["b"].numpy().tobytes() == want["b"].tobytes()
    frags = fragments_read(counting)
    assert len(frags) == HOSTS and len(set(frags)) == HOSTS


def test_a_chunk_the_checkpoint_does_not_hold_is_named(saved: Path) -> None:
    reader, counting = counted(saved)
    reader.read_metadata()
    with pytest.raises(ManifestError, match="does not hold"):
        reader.read_data(LoadPlan([_read("w", (0, 0), (1, 1), "x", chunk=(1, 0))]),
                         _Planner({"x": torch.empty(1, 1)})).wait()
    assert fragments_read(counting) == []


def test_read_once_reads_the_root_and_only_its_responsible_fragments_bit_exact(
        saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column blocks of the row-sharded ``w`` (every rank meets every fragment) and ``b`` whole,
    read once across the hosts: each rank reads the root and the one fragment it sends from."""
    import threading

    from tests.restoring.test_readonce import on_hosts as exchange_hosts

    import ckptio.dcp.reader as reader_module

    local = threading.local()
    monkeypatch.setattr(reader_module, "default_coordinator", lambda: local.host)
    rows, cols, arrays = ROWS // HOSTS, COLS // HOSTS, full()

    def body(rank: int, host: object) -> tuple[list[str], int, bool]:
        local.host = host
        reader, counting = counted(saved)
        reader.read_once = True
        reader.read_metadata()
        reads = [_read("w", (0, rank * cols), (rows, cols), f"w{i}", chunk=(i * rows, 0)) for i in range(HOSTS)]
        targets = {f"w{i}": torch.empty(rows, cols) for i in range(HOSTS)}
        targets["b"] = torch.empty(COLS, dtype=torch.float64)
        reader.read_data(LoadPlan([*reads, _read("b", (0,), (COLS,), "b")]), _Planner(targets)).wait()
        exact = all(targets[f"w{i}"].numpy().tobytes() ==
                    arrays["w"][i * rows : (i + 1) * rows, rank * cols : (rank + 1) * cols].tobytes()
                    for i in range(HOSTS)) and targets["b"].numpy().tobytes() == arrays["b"].tobytes()
        return fragments_read(counting), counting.bytes_read, exact

    results = exchange_hosts(HOSTS, body)
    for r in results:
        assert not isinstance(r, BaseException), r
    assert all(exact for _f, _n, exact in results)
    assert all(len(frags) <= 1 for frags, _n, _e in results)
    assert len({f for frags, _n, _e in results for f in frags}) == HOSTS  # every fragment, by one rank
    stored = sum(p.stat().st_size for p in (saved / str(STEP)).iterdir())
    assert sum(n for _f, n, _e in results) <= 1.1 * stored + HOSTS * (saved / str(STEP) / "ckptio.manifest.json"
                                                                        ).stat().st_size
