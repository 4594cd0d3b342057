"""Leaves whose value differs per host: ``ckptio.PerHost`` and stateful objects (data loaders).

Most of a state is the same on every host (replicated values) or split
between hosts (sharded arrays); a data pipeline's position is neither: each
process reads its own part of the data, so each has its own iterator state.
Such a leaf is saved by **every** host (its own value), inside the same
atomic commit as the rest of the state, and each host restores its own.

Two kinds of leaf are per-host:

* ``ckptio.PerHost(value)``: ``value`` is a small pytree (dicts, lists,
  tuples, ints, floats, bools, str, bytes, None, small numpy arrays or torch
  tensors) or a stateful object;
* a **stateful object** on its own: anything with ``state_dict()`` /
  ``load_state_dict(state)`` (torch's convention: torchdata's
  ``StatefulDataLoader``, an LR scheduler) or ``get_state()`` /
  ``set_state(state)`` (grain's ``DatasetIterator`` and ``DataLoaderIterator``).
  It is saved through its state and, when the restore target holds the
  object, restored into it in place.

A per-host state lives inline in the manifest (JSON, no pickle): keep it
small (at most 1 MiB of JSON per host:
:data:`ckptio.manifest.hoststate.MAX_STATE_BYTES`). An object whose state
holds big tensors (a model, an optimizer) belongs in the tree as its
``state_dict()``, not as a stateful leaf.

Restoring with another number of hosts is refused, naming the item and both
host counts, unless the target's ``PerHost`` has ``on_resize``: a function
``(saved_states, host, num_hosts) -> state`` that gives host ``host`` of
``num_hosts`` its state from the list of every saved host's state
(:func:`take_modulo`: host ``i`` takes saved host ``i mod len(saved)``).
One exception, as DCP treats a ``Stateful``: a stateful target that is not a
data pipeline (not iterable: an LR scheduler, a metrics tracker) holds the
same state on every host, so on another host count every host takes the
state saved by host 0 (:func:`take_first`). Data loaders and iterators, and
anything wrapped in ``PerHost``, keep the refusal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["OnResize", "PerHost", "is_data_pipeline", "is_per_host_leaf", "is_stateful", "load_state",
           "resize_hook", "state_of", "take_first", "take_modulo"]

#: ``(saved_states, host, num_hosts) -> this host's state``: see :class:`PerHost`.
OnResize = Callable[[Sequence[Any], int, int], Any]


def take_modulo(saved: Sequence[Any], host: int, num_hosts: int) -> Any:
    """An ``on_resize`` hook: host ``i`` takes the state saved by host ``i mod len(saved)``.

    Right for data pipelines that shard their input by ``host mod N``; a pipeline that
    reshards its own state (grain's, when it offers to) should pass its own function.
    """
    return saved[host % len(saved)]


class PerHost:
    """A leaf each host saves its own value of (a data iterator's position, per-host metrics).

    ``value``: a small pytree or a stateful object (see the module docstring). As a restore
    target, ``PerHost(template, on_resize=...)`` restores this host's saved state (into the
    template if it is a stateful object) and gives back a ``PerHost`` holding it.
    """

    __slots__ = ("on_resize", "value")

    def __init__(self, value: Any, *, on_resize: OnResize | None = None) -> None:
        self.value = value
        self.on_resize = on_resize

    def __repr__(self) -> str:
        return f"PerHost({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerHost) and _same(self.value, other.value)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays compare elementwise
        return a is b


def is_stateful(obj: Any) -> bool:
    """True for an object saved through its state: ``state_dict``/``load_state_dict`` or
    ``get_state``/``set_state`` (a class, not an instance, is never one)."""
    if isinstance(obj, type):
        return False
    return ((callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))
            or (callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None))))


def take_first(saved: Sequence[Any], host: int, num_hosts: int) -> Any:
    """An ``on_resize`` hook: every host takes the state saved by host 0 (a state the same on every host)."""
    return saved[0]


def is_data_pipeline(obj: Any) -> bool:
    """True for a stateful object whose state is a position in data: an iterable or an iterator
    (``StatefulDataLoader``, grain's iterators), which each host holds its own of."""
    return callable(getattr(obj, "__iter__", None)) or callable(getattr(obj, "__next__", None))


def resize_hook(target: Any) -> OnResize | None:
    """How a restore by another number of hosts maps saved states to a host for ``target``: its
    ``PerHost``'s ``on_resize``, :func:`take_first` for a stateful object that is not a data
    pipeline, else None (refused)."""
    if isinstance(target, PerHost):
        return target.on_resize
    if is_stateful(target) and not is_data_pipeline(target):
        return take_first
    return None


def is_per_host_leaf(leaf: Any) -> bool:
    """True for a leaf every host saves its own of: a :class:`PerHost` or a stateful object."""
    return isinstance(leaf, PerHost) or is_stateful(leaf)


def state_of(leaf: Any) -> Any:
    """The state to save of a per-host leaf (a stateful object's state, or the plain value)."""
    value = leaf.value if isinstance(leaf, PerHost) else leaf
    if not is_stateful(value):
        return value
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return value.state_dict()
    return value.get_state()


def load_state(target: Any, state: Any) -> Any:
    """``state`` restored into ``target`` (a stateful object, in place, returned), or ``state``
    itself where ``target`` is not stateful (a template). A PerHost target gives a PerHost back."""
    if isinstance(target, PerHost):
        return PerHost(load_state(target.value, state), on_resize=target.on_resize)
    if not is_stateful(target):
        return state
    if callable(getattr(target, "load_state_dict", None)) and callable(getattr(target, "state_dict", None)):
        target.load_state_dict(state)
    else:
        target.set_state(state)
    return target
