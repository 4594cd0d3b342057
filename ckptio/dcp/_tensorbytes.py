"""A torch tensor's bytes as numpy, in the fewest torch calls that give the GIL away.

Most dispatched torch ops (``detach``, ``reshape``, ``view``, ``resolve_conj``, ``empty``)
release the GIL and take it back. Beside a training thread that holds the GIL on a core of
its own, each such call then waits for the GIL to come back, up to the interpreter's switch
interval (5 ms). Measured here with the step thread alone on one core (``ckptio bench --train
--pin``'s setting), a call: ``detach`` 6.9 ms, ``reshape`` 25 ms, ``view(shape)`` 21 ms, against
~0.3 ms for ``numpy()`` and microseconds for attribute reads. ckptio-dcp-async made four to
seven of them per tensor when staging and again when writing (32 tensors: a 2-2.5 s stall and
0.03-0.04 GiB/s in the background, where stock DCP's async save kept 0.10-0.11 GiB/s).

So a plain tensor (CPU, strided, C-contiguous, no autograd, no conjugate or negative bit)
goes to numpy with ``numpy()`` alone, or one ``view`` to an integer of its size for the dtypes
numpy has no name for (bfloat16, the float8s); anything else returns None, and the caller
takes its general path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptio.state.leaves import TORCH_AS_INT

__all__ = ["plain_array", "plain_bytes", "tensor_over"]


def plain_array(t: Any) -> np.ndarray | None:
    """The plain tensor ``t`` as a C-contiguous numpy array sharing its memory, of ``t``'s numpy
    dtype or, for the dtypes numpy has no name for, an integer of the same size; None when ``t``
    is not plain (another device, a layout or subclass of its own, a strided view, autograd
    history, a conjugate or negative bit, quantized): ``numpy()`` refuses most of those itself."""
    import torch

    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.requires_grad:
        return None
    try:
        as_int = TORCH_AS_INT.get(str(t.dtype).removeprefix("torch."))
        arr = t.view(getattr(torch, as_int)).numpy() if as_int else t.numpy()
    except (RuntimeError, TypeError):  # a device tensor, quantized, sparse, conj/neg bit, no numpy dtype
        return None
    return arr if arr.flags.c_contiguous else None


def plain_bytes(t: Any) -> np.ndarray | None:
    """:func:`plain_array`'s bytes as a 1-D uint8 array (None where it is None)."""
    arr = plain_array(t)
    return None if arr is None else arr.reshape(-1).view(np.uint8)


def tensor_over(data: np.ndarray, like: np.ndarray, dtype: Any) -> Any:
    """A torch tensor of ``dtype`` over the uint8 buffer ``data``, shaped as ``like`` (what
    :func:`plain_array` gave for a tensor of ``dtype``): shares ``data``'s memory."""
    import torch

    out = torch.from_numpy(data.view(like.dtype).reshape(like.shape))
    return out if out.dtype == dtype else out.view(dtype)
