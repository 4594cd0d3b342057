"""The benchmark state: generated once per process, identical in every case.

Arrays are random normal values (incompressible like real weights, so a
compressing anchor pays the CPU and wins almost nothing, as it would in
training) drawn from one seeded generator: every case, in every process,
sees the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptio.bench.spec import StateSpec

__all__ = ["array_names", "describe", "generate", "rank_subset", "state_nbytes", "to_jax", "to_numpy", "to_torch", "verify"]


def _np_dtype(name: str) -> np.dtype[Any]:
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes  # a numpy dependency of ckptio; imported only when asked for

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def array_names(count: int) -> list[str]:
    """Zero-padded so that lexicographic order is creation order in every framework."""
    width = max(3, len(str(count - 1)))
    return [f"a{i:0{width}d}" for i in range(count)]


def _shape(elems: int) -> tuple[int, ...]:
    # 2-D like a weight matrix when it divides evenly; otherwise flat.
    return (elems // 1024, 1024) if elems >= 1024 and elems % 1024 == 0 else (elems,)


def describe(spec: StateSpec) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
    """name -> (shape, dtype) of every array :func:`generate` makes, without making them."""
    dtype = _np_dtype(spec.dtype)
    elems = max(1, spec.total_bytes // dtype.itemsize // spec.count)
    return {name: (_shape(elems), dtype) for name in array_names(spec.count)}


def generate(spec: StateSpec) -> dict[str, np.ndarray]:
    """``spec.count`` separately allocated arrays of ``spec.total_bytes // count`` bytes each.

    Separate allocations matter: a view into one big buffer would make
    ``torch.save`` (and DCP, which uses it per tensor) write the whole
    underlying storage for every view.
    """
    rng = np.random.default_rng(spec.seed)
    out: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in describe(spec).items():
        elems = int(np.prod(shape))
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            arr = rng.integers(info.min, info.max, size=elems, dtype=dtype, endpoint=True)
        elif dtype.itemsize >= 4:
            arr = rng.standard_normal(elems, dtype=np.float32).astype(dtype, copy=False)
        else:  # float16 / bfloat16 / float8: draw float32, then round
            arr = rng.standard_normal(elems, dtype=np.float32).astype(dtype)
        out[name] = arr.reshape(shape)
    return out


def rank_subset(state: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The arrays rank ``rank`` owns: every ``world_size``-th, names kept globally unique."""
    return {k: v for i, (k, v) in enumerate(sorted(state.items())) if i % world_size == rank}


def state_nbytes(state: Mapping[str, Any]) -> int:
    return sum(int(np.asarray(v).nbytes) if isinstance(v, np.ndarray) else _nbytes(v) for v in state.values())


def _nbytes(x: Any) -> int:
    if hasattr(x, "nbytes"):
        return int(x.nbytes)
    return int(x.numel() * x.element_size())  # torch


def to_jax(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """jax arrays on the default (CPU) device, materialised before any timing starts."""
    import jax

    out = {k: jax.device_put(v) for k, v in state.items()}
    jax.block_until_ready(out)
    return out


def to_torch(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """torch tensors sharing the numpy memory (no copy); bfloat16 goes through an int16 view."""
    import torch

    out: dict[str, Any] = {}
    for k, v in state.items():
        if v.dtype.name == "bfloat16":
            out[k] = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
        else:
            out[k] = torch.from_numpy(v)
    return out


def to_numpy(x: Any) -> np.ndarray:
    """One restored leaf (numpy, jax or torch) as numpy, without copying when avoidable."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def verify(restored: Any, expected: Mapping[str, np.ndarray]) -> str | None:
    """None when ``restored`` holds exactly ``expected``'s arrays; else what differs."""
    if not isinstance(restored, Mapping):
        return f"restored a {type(restored).__name__}, expected a mapping"
    missing = sorted(set(expected) - set(restored))
    if missing:
        return f"{len(missing)} arrays missing (first: {missing[0]})"
    for k, want in expected.items():
        got = to_numpy(restored[k])
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"{k}: got {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
        # Compare bit patterns: NaN-safe and exact for every dtype.
        if not np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
            return f"{k}: contents differ"
    return None
