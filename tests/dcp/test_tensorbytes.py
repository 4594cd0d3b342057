"""Plain tensors reach numpy without the torch calls that give the GIL away (ckptio.dcp._tensorbytes).

Beside a training thread that holds the GIL, every dispatched torch op a background save makes waits
for the GIL to come back (up to 5 ms each); staging and writing a plain tensor make none (one view
for bfloat16 and the float8s). Counted here as the torch calls made from Python (a function mode),
never timed: attribute reads and ``numpy()`` keep the GIL and are not counted. Tensors that are not
plain take the general path, byte for byte the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.overrides import TorchFunctionMode

from ckptio.dcp import Reader, Writer
from ckptio.dcp._codec import numpy_view
from ckptio.dcp._tensorbytes import plain_array, plain_bytes
from ckptio.dcp.stager import HostBuffers, stage_state_dict
from ckptio.dcp.writer import _raw_bytes

#: Calls that keep the GIL: attribute reads (``shape``, ``dtype``, ``requires_grad``), ``numel()``, ``numpy()``,
#: and ``no_grad``'s flag (once a save).
_KEEP_GIL = {"__get__", "numpy", "data_ptr", "numel", "_set_grad_enabled"}


class _Ops(TorchFunctionMode):
    """Records the torch functions and methods called from Python inside the block, but those of
    :data:`_KEEP_GIL`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in _KEEP_GIL:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _bytes(t: torch.Tensor) -> bytes:
    """The reference: a contiguous copy's bytes, through torch's own uint8 view."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(4, 5, generator=g),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "bf16": torch.randn(6, 2, generator=g).to(torch.bfloat16),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
    }
    return out


@pytest.mark.parametrize("name", list(_tensors()))
def test_a_plain_tensor_is_its_own_bytes_shared_not_copied(name: str) -> None:
    t = _tensors()[name]
    flat = plain_bytes(t)
    assert flat is not None and flat.dtype == np.uint8 and flat.ndim == 1
    assert bytes(flat) == _bytes(t)
    assert plain_array(t).shape == tuple(t.shape)  # type: ignore[union-attr]
    assert flat.ctypes.data == t.data_ptr(), "a view of the tensor's memory, not a copy"


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_tensors_that_are_not_plain_are_left_to_the_general_path() -> None:
    base = torch.randn(4, 6)
    not_plain = {
        "strided view": base.t(),
        "autograd": torch.nn.Parameter(torch.ones(3)),
        "conjugate bit": torch.randn(3, dtype=torch.complex64).conj(),
        "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
        "sparse": torch.ones(2, 2).to_sparse(),
        "meta device": torch.empty(3, device="meta"),
        "negative bit float32": torch._neg_view(torch.randn(3)),
        "negative bit bfloat16": torch._neg_view(torch.randn(3).to(torch.bfloat16)),
        "negative bit float8": torch._neg_view(torch.randn(3).to(torch.float8_e4m3fn)),
    }
    for why, t in not_plain.items():
        assert plain_array(t) is None, why


def test_staging_plain_tensors_calls_no_torch_op_and_two_views_for_bfloat16() -> None:
    pool = HostBuffers()
    state = {"f32": torch.randn(64, 8), "i64": torch.arange(1000), "bool": torch.ones(9, dtype=torch.bool)}
    stage_state_dict(state, pool)  # buffers made on the first save; reused below
    with _Ops() as counted:
        staged = stage_state_dict(state, pool)
    assert counted.ops == [], counted.ops
    for k, v in state.items():
        assert staged[k].dtype == v.dtype and staged[k].shape == v.shape and torch.equal(staged[k], v)
        assert staged[k].data_ptr() != v.data_ptr()
    bf = {"bf16": torch.randn(5, 3).to(torch.bfloat16)}
    with _Ops() as counted:
        staged = stage_state_dict(bf, pool)
    assert counted.ops == ["view", "view"], counted.ops  # into int16 and back, each keeping the shape
    assert staged["bf16"].dtype == torch.bfloat16 and torch.equal(staged["bf16"], bf["bf16"])


def test_staging_still_copies_every_other_tensor_bit_exact() -> None:
    base = torch.randn(4, 6)
    state = {"strided": base.t(), "param": torch.nn.Parameter(torch.randn(3)),
             "conj": torch.randn(3, dtype=torch.complex64).conj(), "empty": torch.empty(0, 4)}
    staged = stage_state_dict(state, HostBuffers())
    for k, v in state.items():
        got = staged[k]
        assert got.shape == v.shape and not got.requires_grad
        assert torch.equal(got.resolve_conj(), v.detach().resolve_conj()), k


def test_writing_a_plain_chunk_calls_no_torch_op() -> None:
    from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

    t = torch.randn(32, 4)
    item = _create_write_item_for_tensor("w", t)
    with _Ops() as counted:
        view = _raw_bytes(item, t)
    assert counted.ops == [] and bytes(view) == _bytes(t)
    with _Ops() as general:
        _raw_bytes(item, torch.nn.Parameter(t))  # the general path: detach, resolve_conj, resolve_neg, ...
    assert len(general.ops) >= 3, general.ops
    strided = torch.randn(4, 32).t()  # the general path: a contiguous copy, same bytes
    assert bytes(_raw_bytes(_create_write_item_for_tensor("s", strided), strided)) == _bytes(strided)


def test_numpy_view_of_each_dtype_keeps_shape_and_bytes() -> None:
    for name, t in _tensors().items():
        arr = numpy_view(t, name)
        assert arr.shape == tuple(t.shape) and bytes(arr.reshape(-1).view(np.uint8)) == _bytes(t), name


def test_a_state_of_every_kind_round_trips_through_async_save(tmp_path: Any) -> None:
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        state = {**_tensors(), "strided": torch.randn(3, 5).t(), "param": torch.nn.Parameter(torch.randn(4))}
        expected = {k: _bytes(v) for k, v in state.items()}
        dcp.async_save(state, storage_writer=Writer(tmp_path / "ck")).result()
        out = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
        dcp.load(out, storage_reader=Reader(tmp_path / "ck"))
        assert {k: _bytes(v) for k, v in out.items()} == expected
    finally:
        if own:
            dist.destroy_process_group()
