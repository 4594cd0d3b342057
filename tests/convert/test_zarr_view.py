"""The read-only zarr v3 view: listing, slices bit-exact, bytes read close to the slice."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

import ckptio  # noqa: E402
from ckptio.backends import open_backend  # noqa: E402
from ckptio.backends.wrappers import CountingBackend  # noqa: E402


def _save(url: str, **kw) -> np.ndarray:
    full = np.arange(96 * 64, dtype=np.float32).reshape(96, 64)
    uneven = [((slice(0, 40), slice(None)), full[:40]), ((slice(40, 96), slice(None)), full[40:])]
    state = {
        "params": {"w": ckptio.Sharded(full.shape, full.dtype, uneven), "b": (full[0] / 3).astype(ml_dtypes.bfloat16),
                   "big_endian": np.arange(10, dtype=">i4")},
        "opt": [np.ones(5, np.int64), np.zeros((2, 3), np.complex64)],
        "step": 12,
        "when": np.array(["2026-01-01"], "M8[D]"),
    }
    ckptio.save(url, state, step=12, **kw).result()
    return full


@pytest.mark.parametrize("kind", ["local", "mem"])
def test_zarr_lists_items_and_reads_slices_bit_exact(tmp_path, kind):
    url = str(tmp_path) if kind == "local" else f"mem://zarr-{tmp_path.name}"
    full = _save(url)
    g = zarr.open_group(store=ckptio.zarr_store(url), mode="r")
    assert sorted(g.group_keys()) == ["opt", "params"]
    assert sorted(g["params"].array_keys()) == ["b", "big_endian", "w"]
    assert g.attrs["ckptio_values"] == {"step": 12} and g.attrs["ckptio_unsupported"] == ["when"]
    w = g["params/w"]
    assert w.shape == full.shape and w.chunks == (8, 64)  # gcd of the uneven split 0/40/96
    for sl in [np.s_[10:20], np.s_[35:45, 3:9], np.s_[:, 7], np.s_[95]]:
        assert np.array_equal(w[sl], full[sl]), sl
    b = g["params/b"]
    assert b.attrs["ckptio_dtype"] == "bfloat16"
    assert b[:].view(ml_dtypes.bfloat16).tobytes() == (full[0] / 3).astype(ml_dtypes.bfloat16).tobytes()
    assert (g["params/big_endian"][:] == np.arange(10)).all()
    assert (g["opt/0"][:] == 1).all() and g["opt/1"].dtype == np.complex64


def test_zarr_reads_only_the_chunks_a_slice_needs(tmp_path):
    full = _save(str(tmp_path), engine_config=ckptio.EngineConfig(block_size=1024))
    counting = CountingBackend(open_backend(str(tmp_path)))
    g = zarr.open_group(store=ckptio.zarr_store(str(tmp_path), backend=counting), mode="r")
    counting.reset()
    assert np.array_equal(g["params/w"][10:20], full[10:20])
    row = 64 * 4
    # Rows 10..20 lie in chunks 1 and 2 (8 rows each): 16 rows, not the 96 of the array
    # (reads round to checksum blocks: 1 KiB here, 4 MiB by default).
    assert counting.bytes_read == 16 * row


def test_zarr_store_is_read_only(tmp_path):
    _save(str(tmp_path))
    g = zarr.open_group(store=ckptio.zarr_store(str(tmp_path)), mode="r")
    with pytest.raises(Exception):
        g["params/w"][0] = 1
