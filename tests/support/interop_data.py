"""The states the interop tests save and check (numpy only: shared by workers and tests).

Bit patterns come from a seeded generator, so every process (each DCP rank,
the Orbax worker, the test that reads the result through zarr) builds the
same global arrays without passing them around.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

#: Checksum block size of the saved checkpoints: small, so ranged reads stay close to what they need.
BLOCK = 256


def rand_bits(name: str, shape: tuple[int, ...], dtype: object) -> np.ndarray:
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    return raw.view(dtype).reshape(shape)


#: DCP: name -> (shape, dtype, DTensor shard dim or None for a plain, replicated tensor).
DCP_TENSORS = {
    "w": ((64, 48), np.float32, 0),
    "emb": ((40, 16), ml_dtypes.bfloat16, 1),
    "odd": ((7, 6), np.float32, 0),  # uneven rows: 4 + 3
    "ids": ((10,), np.int64, None),
}

#: Orbax: name -> (shape, dtype, PartitionSpec axes on the 4x2 mesh ("x", "y")).
ORBAX_ARRAYS = {
    "params/w": ((64, 32), np.float32, ("x", "y")),
    "params/b": ((32,), ml_dtypes.bfloat16, ("y",)),
    "emb": ((48, 24), np.float32, (None, "y")),
    "i8": ((16, 8), np.int8, ("x", None)),
}


def dcp_arrays() -> dict[str, np.ndarray]:
    return {name: rand_bits(f"dcp/{name}", shape, dt) for name, (shape, dt, _d) in DCP_TENSORS.items()}


def orbax_arrays() -> dict[str, np.ndarray]:
    return {name: rand_bits(f"orbax/{name}", shape, dt) for name, (shape, dt, _s) in ORBAX_ARRAYS.items()}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes()
