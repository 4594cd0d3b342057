"""Restore targets from a live state: :func:`restore_target`.

The abstract state of the README's recipe, for every leaf a state may hold,
so that ``ckptio.restore(url, step, target=restore_target(state))`` gives
back a state of the same types, shapes, dtypes and shardings (as Orbax's
``ocp.utils.to_shape_dtype_struct`` does for jax).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ckptio.restoring import _PY_SCALARS, _is_target_leaf
from ckptio.state.leaves import Sharded
from ckptio.state.perhost import is_per_host_leaf
from ckptio.state.tree import flatten_named, unflatten

__all__ = ["restore_target"]


def restore_target(state: Any, *, inplace: bool = False) -> Any:
    """A restore target for ``state``: the same tree, each leaf replaced by what restores it.

    * a jax array (typed PRNG keys included): ``jax.ShapeDtypeStruct`` with its
      shape, dtype and sharding (swap in another sharding to reshard); an
      uncommitted one (``x.committed`` False: jax placed it, as optax does its
      counters) gets none, and restores uncommitted on the default device;
    * a numpy array: a read-only zero-stride view of its shape and dtype (no
      memory), which restores a new numpy array;
    * a torch tensor: a ``meta`` tensor of its shape and dtype (no memory),
      which restores a new CPU tensor;
    * a :class:`ckptio.Sharded`: its pieces' slices, which restore those slices;
    * Python scalars (int, float, bool, complex, str, bytes), numpy scalars,
      ``None`` and ``jax.ShapeDtypeStruct``: themselves (a Python scalar
      restores the saved value as its type, refusing an incompatible one);
    * a ``ckptio.PerHost`` or a stateful object (a data loader): itself, which
      restores this host's state into it (:mod:`ckptio.state.perhost`).

    ``inplace=True`` keeps C-contiguous writeable numpy arrays, torch tensors
    and Sharded pieces themselves as their targets: the restore fills them (no
    second copy of the state; jax arrays are immutable and never are).

    Nodes are walked as a save walks them (:mod:`ckptio.state.tree`) and keep their
    types: a flax ``TrainState`` gives a ``TrainState`` of targets, static
    fields included. A leaf that is none of these raises TypeError naming its
    path.
    """
    names, leaves, structure = flatten_named(state, is_leaf=_is_target_leaf)
    jax = sys.modules.get("jax")
    torch = sys.modules.get("torch")
    targets = {name: _target(name, leaf, inplace, jax, torch) for name, leaf in zip(names, leaves)}
    return unflatten(structure, targets.__getitem__)


def _target(name: str, leaf: Any, inplace: bool, jax: Any, torch: Any) -> Any:
    """The restore target of one leaf (see :func:`restore_target`)."""
    if leaf is None or isinstance(leaf, (np.generic, *_PY_SCALARS)):
        return leaf
    if isinstance(leaf, bytearray):  # saved as bytes, so restored as bytes
        return bytes(leaf)
    if isinstance(leaf, np.ndarray):
        if inplace and leaf.flags.c_contiguous and leaf.flags.writeable:
            return leaf
        # One element broadcast to the shape: a shape and dtype without the memory. Read-only,
        # so a restore makes a new array of it rather than filling it.
        return np.broadcast_to(np.empty((), leaf.dtype), leaf.shape)
    if isinstance(leaf, Sharded):
        return leaf if inplace else Sharded(leaf.shape, leaf.dtype, [(index, None) for index, _data in leaf.pieces])
    if jax is not None and isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if jax is not None and isinstance(leaf, jax.Array):
        # An uncommitted array (placed by jax, not by you: optax's step counters) restores
        # uncommitted, so jit may still move it next to sharded ones; pinned to its device, a
        # jitted step would refuse the mix.
        sharding = leaf.sharding if getattr(leaf, "committed", True) else None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if torch is not None and isinstance(leaf, torch.Tensor):
        return leaf if inplace else torch.empty_like(leaf.detach(), device="meta")
    if is_per_host_leaf(leaf):  # a data loader, a PerHost: its own target, restored in place
        return leaf
    raise TypeError(
        f"leaf {name or '<root>'!r} is a {type(leaf).__name__}, which restore_target does not know: leaves may be "
        "jax / numpy arrays, torch tensors, ckptio.Sharded, numpy scalars, int, float, bool, complex, str, bytes "
        "or None"
    )
