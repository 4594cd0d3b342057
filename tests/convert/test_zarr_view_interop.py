"""Checkpoints written by the framework adapters, read through zarr slice by slice.

A DCP checkpoint saved by ``ckptio.dcp.Writer`` from 2 ranks (gloo, real
processes, DTensor Shard(0)/Shard(1), uneven rows) and one saved by
``ckptio.orbax`` on a 4x2 mesh (8 CPU devices, in a subprocess), each on
local disk and on fake GCS, are read through ``ckptio.zarr_store``: every
chunk alone and some slices across chunks, bit-exact, while a
CountingBackend counts the bytes each read fetches. The checkpoints are
saved with 256-byte checksum blocks, so a read costs at most its chunks'
bytes rounded out to those blocks (a chunk that is a whole saved shard:
exactly its bytes).
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
pytest.importorskip("torch")
if importlib.util.find_spec("jax") is None or importlib.util.find_spec("orbax") is None:
    pytest.skip("needs jax and orbax-checkpoint", allow_module_level=True)

import interop_data as D  # noqa: E402
from tests.conftest import GCS_TEST_BUCKET  # noqa: E402
from interop_run import check, run_dcp_ranks, run_orbax_worker  # noqa: E402

import ckptio  # noqa: E402
from ckptio.backends import open_backend  # noqa: E402
from ckptio.backends.wrappers import CountingBackend  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402

pytestmark = pytest.mark.slow  # writes every adapter's checkpoint through Orbax and DCP first


class Saved:
    """Where each source's checkpoint landed: (url, step) per place, plus the GCS endpoint."""

    def __init__(self) -> None:
        self.where: dict[tuple[str, str], tuple[str, int | None]] = {}
        self.endpoint: str | None = None

    def backend(self, url: str) -> Any:
        if url.startswith("gs://"):
            from ckptio.backends.gcs import GCSBackend

            return GCSBackend(url, endpoint=self.endpoint)
        return open_backend(url)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Saved:
    """Both adapters' checkpoints, saved once for the module (fake GCS if its binary is there)."""
    out = Saved()
    work = tmp_path_factory.mktemp("interop")
    try:
        fake = request.getfixturevalue("fake_gcs")
    except pytest.skip.Exception:
        fake = None
    env: dict[str, str] = {}
    dcp_targets = [str(work / "dcp")]
    out.where[("dcp", "local")] = (str(work / "dcp"), None)
    if fake is not None:
        out.endpoint = fake.url
        gs = f"gs://{GCS_TEST_BUCKET}/interop-{os.getpid()}"
        env = {"STORAGE_EMULATOR_HOST": fake.url, "INTEROP_GCS_URL": f"{gs}/orbax"}
        dcp_targets.append(f"{gs}/dcp")
        out.where[("dcp", "gcs")] = (f"{gs}/dcp", None)
        out.where[("orbax", "gcs")] = (f"{gs}/orbax/default", 1)  # external storage: <storage>/<item>/<step>
    run_dcp_ranks(2, *dcp_targets, env=env)
    results = run_orbax_worker(work, "adapter_local", *(["adapter_gcs"] if fake else []), env=env)
    check(results, "adapter_local")
    if fake is not None:
        check(results, "adapter_gcs")
    out.where[("orbax", "local")] = (str(work / "adapter_local" / "1" / "default"), None)
    return out


def _expected(source: str) -> dict[str, np.ndarray]:
    return D.dcp_arrays() if source == "dcp" else D.orbax_arrays()


def _chunk_boxes(shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[tuple[slice, ...]]:
    grid = [range(0, n, c) for n, c in zip(shape, chunks)]
    return [
        tuple(slice(g[i], min(g[i] + c, n)) for g, i, c, n in zip(grid, idx, chunks, shape))
        for idx in np.ndindex(*(len(g) for g in grid))
    ]


def _touched_bytes(
    sel: tuple[slice, ...], shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int
) -> int:
    """Bytes of the chunks a selection touches (what zarr asks the store for)."""
    total = 0
    for box in _chunk_boxes(shape, chunks):
        if all(max(b.start, s.start) < min(b.stop, s.stop) for b, s in zip(box, sel)):
            total += math.prod(b.stop - b.start for b in box) * itemsize
    return total


CASES = [("dcp", "local"), ("dcp", "gcs"), ("orbax", "local"), ("orbax", "gcs")]


@pytest.mark.parametrize("source,place", CASES)
def test_zarr_reads_adapter_checkpoints_slice_by_slice_bit_exact(
    saved: Saved, source: str, place: str
) -> None:
    if (source, place) not in saved.where:
        pytest.skip("fake-gcs-server binary not found")
    url, step = saved.where[(source, place)]
    counting = CountingBackend(saved.backend(url))
    try:
        _check_zarr_reads(counting, url, step, source)
    finally:
        run_sync(counting.close())  # its HTTP session lives on the engine's loop


def _check_zarr_reads(counting: CountingBackend, url: str, step: int | None, source: str) -> None:
    g = zarr.open_group(store=ckptio.zarr_store(url, step, backend=counting), mode="r")
    for name, want in _expected(source).items():
        z = g[name]
        assert z.shape == want.shape, name
        itemsize = want.dtype.itemsize
        chunks = tuple(z.chunks)
        whole_shards = z.attrs["ckptio_shards"] == len(_chunk_boxes(want.shape, chunks))
        view = want.view(np.uint16) if want.dtype.name == "bfloat16" else want  # zarr serves bf16 as uint16
        assert z.dtype == view.dtype, (name, z.dtype)
        for box in _chunk_boxes(want.shape, chunks):  # every chunk, one by one
            counting.reset()
            got = z[box]
            assert D.same_bits(got, view[box]), (name, box)
            nbytes = view[box].nbytes
            if whole_shards:  # the chunk is a saved shard: exactly its bytes are read
                assert counting.bytes_read == nbytes, (name, box, counting.bytes_read)
            else:  # part of a shard: rounded out to at most two more checksum blocks
                assert nbytes <= counting.bytes_read <= nbytes + 2 * D.BLOCK, (name, box, counting.bytes_read)
        n0 = want.shape[0]
        for sel in [np.s_[1 : n0 - 1], np.s_[n0 // 3 : n0 // 2], np.s_[n0 - 1 : n0]]:
            full = (sel,) + tuple(slice(0, n) for n in want.shape[1:])
            counting.reset()
            assert D.same_bits(z[full], view[full]), (name, sel)
            touched = _touched_bytes(full, want.shape, chunks, itemsize)
            n_chunks = sum(
                1
                for b in _chunk_boxes(want.shape, chunks)
                if all(max(b_.start, s.start) < min(b_.stop, s.stop) for b_, s in zip(b, full))
            )
            assert view[full].nbytes <= counting.bytes_read <= touched + 2 * D.BLOCK * n_chunks, (name, sel)
