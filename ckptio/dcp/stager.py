"""Staging for ``dcp.async_save``: copy the state dict into host buffers reused across saves.

Fresh host memory costs page faults on every save (several times slower
than copying into memory already touched), so staged tensors live in
buffers from a :class:`HostBuffers` pool, which outlives each save.

A buffer goes back to the pool when the staged tensor (or DTensor) that
uses it is garbage: DCP drops the staged state dict once its upload is done
-- in the thread executor and in the process executor alike (the parent
holds it until the checkpoint process answers). So a new save never
overwrites buffers an earlier save is still writing, without the caller
having to wait, and buffers are reused as soon as they are free. For the
process executor torch moves a buffer into shared memory the first time it
is sent; as the pool keeps it, later saves send it without another copy.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ckptio.dcp._tensorbytes import plain_array, tensor_over
from ckptio.system import copy_bytes
from ckptio.system.bufferpool import aligned_empty
from ckptio.system.freelists import FreeLists

__all__ = ["DEFAULT_BUFFERS", "SHARED_BUFFERS", "HostBuffers", "Stager", "stage_state_dict", "state_tensors"]


class HostBuffers:
    """Flat uint8 host buffers by size (pinned ones apart), reused across saves; thread-safe.

    ``shared=True``: unpinned buffers live in shared memory (:func:`ckptio.saving.writers.sidecar.shared_pool`),
    so that a sidecar writer process reads them as staged, without another copy.
    """

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self._free: FreeLists[tuple[int, bool], Any] = FreeLists()

    @property
    def allocated(self) -> int:
        """Buffers allocated so far (for tests and benchmarks)."""
        return self._free.misses

    @property
    def reused(self) -> int:
        """Takes that reused a free buffer so far (for tests and benchmarks)."""
        return self._free.hits

    def take(self, nbytes: int, pinned: bool = False) -> Any:
        """A buffer of ``nbytes`` (a 1-D uint8 CPU tensor), reused when one is free."""
        buf = self._free.take((nbytes, pinned))
        if buf is not None:
            return buf
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if self.shared:
            from ckptio.saving.writers import sidecar

            return torch.from_numpy(sidecar.shared_pool().take(nbytes))
        # Page-aligned, as ckptio's own staging is: torch.empty's memory starts 64 bytes into a
        # page, so an O_DIRECT write could not take it as it is and every async save copied all
        # of its bytes again through the bounce buffer, in the background beside the trainer
        # (ckptio-dcp-async: 272 ms of the step thread's time per 512 MiB save, issue 17).
        return torch.from_numpy(aligned_empty(nbytes))

    def lend(self, owner: Any, buf: Any, pinned: bool) -> None:
        """Take ``buf`` back once ``owner`` (the staged tensor using it) is garbage."""
        weakref.finalize(owner, self._give_back, buf, pinned)

    def _give_back(self, buf: Any, pinned: bool) -> None:
        self._free.give((buf.numel(), pinned), buf, buf.numel())

    def free_bytes(self) -> int:
        return self._free.held_bytes()

    def free_count(self) -> int:
        """The free buffers held (every one ever allocated, once each is given back)."""
        return self._free.count()

    def clear(self) -> None:
        """Drop every free buffer (those still in use return later, and are kept then)."""
        self._free.clear()


#: The pool every Writer uses unless given another: shared, so that a new
#: ``Writer(url_of_step)`` per save still reuses the previous saves' buffers.
DEFAULT_BUFFERS = HostBuffers()
#: The same for writers whose objects a sidecar process writes (``SaveOptions(writer="sidecar")``).
SHARED_BUFFERS = HostBuffers(shared=True)


def stage_state_dict(state_dict: Any, buffers: HostBuffers | None = None,
                     staged: Callable[[Any, Any], None] | None = None) -> Any:
    """A copy of ``state_dict`` that later updates of the original do not reach.

    Tensors and DTensor local shards are copied into pooled host buffers
    (pinned when they come from an accelerator); containers are rebuilt;
    other leaves are kept when immutable and deep-copied otherwise. A tensor
    that appears twice stays one tensor. ``staged(copy, host)`` is called with
    each pooled copy (a tensor, or a DTensor: ``host`` is its local tensor) as
    soon as it is made; the pool takes its buffer back once ``copy`` is garbage.
    """
    pool = buffers if buffers is not None else DEFAULT_BUFFERS
    memo: dict[int, Any] = {}
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        DTensor = ()  # type: ignore[assignment,misc]

    def host_copy(t: Any) -> Any:
        if t.requires_grad:  # the same bytes without autograd: a plain one then takes the fast path
            t = t.detach()
        fast = _host_copy_plain(t, pool)
        if fast is not None:
            return fast
        pinned = t.device.type != "cpu" and torch.cuda.is_available()
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return torch.empty(t.shape, dtype=t.dtype), None
        buf = pool.take(nbytes, pinned)
        out = buf.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out, (buf, pinned)

    def walk(x: Any) -> Any:
        if id(x) in memo:
            return memo[id(x)]
        out: Any
        lent: tuple[Any, bool] | None = None
        if isinstance(x, DTensor):
            local, lent = host_copy(x._local_tensor)
            # The same private constructor DCP's own staging uses: keeps the spec (mesh,
            # placements, global shape) without moving the host copy back to the mesh's device.
            out = DTensor(local, x._spec, requires_grad=False)
        elif type(x) in (torch.Tensor, torch.nn.Parameter):
            out, lent = host_copy(x)
        elif isinstance(x, torch.Tensor):  # ShardedTensor and other subclasses: DCP's way, unpooled
            out = copy.deepcopy(x)
        elif isinstance(x, dict):
            out = copy.copy(x)  # keeps the dict's type (OrderedDict, defaultdict's factory)
            for k, v in x.items():
                out[k] = walk(v)
        elif type(x) in (list, tuple):
            out = type(x)(walk(v) for v in x)
        elif x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            return x
        else:
            out = copy.deepcopy(x)
        if lent is not None:
            pool.lend(out, *lent)
            if staged is not None:
                staged(out, local if isinstance(x, DTensor) else out)
        memo[id(x)] = out
        return out

    try:
        with torch.no_grad():
            return walk(state_dict)
    finally:
        # walk calls itself through its closure: a cycle that holds what it closes over (``memo``:
        # every staged tensor; ``staged``: a caller's checksums of them) until the cyclic GC runs.
        # Buffers go back to the pool when their tensors die, so without this the next save faulted
        # in a fresh copy of the whole state (1.2 s of stall per GiB here) and the process held two.
        memo.clear()
        staged = None


def _host_copy_plain(t: Any, pool: HostBuffers) -> tuple[Any, tuple[Any, bool]] | None:
    """:func:`stage_state_dict`'s copy of a plain CPU tensor, with one GIL-releasing call (the copy)
    where the general path made six (see :mod:`ckptio.dcp._tensorbytes`; this path measured a
    ckptio-dcp-async stall of 2-2.5 s for 32 tensors beside a training thread holding the GIL, stock
    DCP's 0.74 s); None for any other tensor.

    Not torch's ``copy_``: it splits a large copy over its OpenMP threads, which then spin waiting
    for the next parallel region (staging 512 MiB cost 0.25-0.27 s of CPU that way here against
    0.07 s on one thread, ~30 % of a ckptio-dcp-async save's CPU; perf: ``libgomp``). numpy's
    copy runs on one thread, with the GIL released."""
    src = plain_array(t)
    if src is None or src.nbytes == 0:
        return None
    buf = pool.take(src.nbytes, False)
    dst = buf.numpy()
    copy_bytes(memoryview(dst), memoryview(src.reshape(-1).view(np.uint8)))
    return tensor_over(dst, src, t.dtype), (buf, False)


class Stager(AsyncStager):
    """A DCP ``AsyncStager`` that stages into pooled host buffers (for any StorageWriter).

    ``dcp.async_save(sd, storage_writer=w, async_stager=ckptio.dcp.Stager())``;
    :class:`ckptio.dcp.Writer` is one itself.
    """

    _synchronize_after_execute = False  # stage() returns only once the copy is complete

    def __init__(self, buffers: HostBuffers | None = None) -> None:
        self.buffers = buffers

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        return stage_state_dict(state_dict, self.buffers)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        """Buffers stay in the pool for the next save; ``HostBuffers.clear`` frees them."""


def state_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a state dict (DTensors as their local shards), containers walked."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            local = getattr(x, "to_local", None)
            out.append(local() if callable(local) else x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out
