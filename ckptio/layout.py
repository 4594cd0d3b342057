"""Object packing and naming.

Packing: the shards a host owns become objects of about ``object_size``
bytes -- small shards coalesced into one object (few requests, few files),
huge ones cut into several (parallel IO, bounded requests).

Naming: on POSIX a flat directory per checkpoint; on object stores a
hashed first component right under the root, *before* the step::

    flat:    <step_dir>/<save_id>.h00003-00012
    hashed:  h3f/<step_dir>/<save_id>.h00003-00012

Object stores index keys lexicographically and split hot ranges slowly, so
every save spreads its objects over the same ``16**chars`` ranges that
earlier saves already warmed up. The component is a hash of the checkpoint
plus a round-robin over hosts and objects, so the spread is even by
construction (not only in expectation). The leading ``h`` keeps it from ever
looking like a step number.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable

from ckptio.backends.base import join_key

__all__ = ["FanoutNaming", "FlatNaming", "HashedNaming", "Naming", "ObjectPlan", "Piece", "PlannedExtent", "pack"]


@dataclasses.dataclass(slots=True)
class Piece:
    """One staged shard: ``item`` and shard number, with its C-order bytes."""

    item: str
    shard: int
    data: memoryview  # 1-D unsigned bytes


@dataclasses.dataclass(slots=True)
class PlannedExtent:
    item: str
    shard: int
    shard_offset: int
    offset: int  # within the object
    data: memoryview


_ZEROS = memoryview(bytes(1 << 16))  # padding source; alignments up to 64 KiB


@dataclasses.dataclass(slots=True)
class ObjectPlan:
    key: str
    extents: list[PlannedExtent]

    @property
    def size(self) -> int:
        last = self.extents[-1]
        return last.offset + last.data.nbytes

    @property
    def buffers(self) -> list[memoryview]:
        """The object's bytes in order: each extent, after zero padding up to its offset."""
        out, pos = [], 0
        for e in self.extents:
            if e.offset > pos:
                out.append(_ZEROS[: e.offset - pos])
            out.append(e.data)
            pos = e.offset + e.data.nbytes
        return out


class Naming:
    """How an object of a save is named; a strategy per backend."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        raise NotImplementedError

    def prefixes(self) -> list[str]:
        """Top-level components that hold objects outside step directories (for sweeps)."""
        return []


@dataclasses.dataclass(frozen=True)
class FlatNaming(Naming):
    """All of a checkpoint's objects in its own directory (POSIX)."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(step_dir, f"{save_id}.h{host:05d}-{n:05d}")


@dataclasses.dataclass(frozen=True)
class FanoutNaming(Naming):
    """A checkpoint's objects spread over ``fanout`` sub-directories (parallel file systems,
    where one huge directory serialises metadata operations)."""

    fanout: int = 16

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(step_dir, f"d{(n * num_hosts + host) % self.fanout:03d}", f"{save_id}.h{host:05d}-{n:05d}")


@dataclasses.dataclass(frozen=True)
class HashedNaming(Naming):
    """A hashed component first, then the step (object stores)."""

    chars: int = 2

    def component(self, step_dir: str, host: int, num_hosts: int, n: int) -> str:
        slots = 16**self.chars
        seed = int.from_bytes(hashlib.blake2b(step_dir.encode(), digest_size=8).digest(), "big")
        # Global object number interleaves hosts, so all hosts together fill every slot evenly.
        slot = (seed + n * num_hosts + host) % slots
        return f"h{slot:0{self.chars}x}"

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(self.component(step_dir, host, num_hosts, n), step_dir, f"{save_id}.h{host:05d}-{n:05d}")

    def prefixes(self) -> list[str]:
        return [f"h{i:0{self.chars}x}" for i in range(16**self.chars)]


def pack(
    pieces: Iterable[Piece],
    *,
    object_size: int,
    key_for: Callable[[int], str],
    split_align: int = 1 << 20,
    align: int = 1,
) -> list[ObjectPlan]:
    """Pack pieces into objects of about ``object_size`` bytes, in order.

    A piece larger than ``object_size`` is cut at multiples of ``split_align``
    into objects of its own; smaller ones are appended to the current object
    until it would pass the target. ``key_for(n)`` names object ``n``. With
    ``align > 1`` (direct IO), every extent of at least ``align`` bytes starts
    at an aligned offset (zero padding before it), so it can be written and
    read without a bounce copy.
    """
    if align > len(_ZEROS):
        raise ValueError(f"alignment {align} exceeds {len(_ZEROS)}")
    step = max(split_align, object_size - object_size % split_align)
    plans: list[ObjectPlan] = []
    current: list[PlannedExtent] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            plans.append(ObjectPlan(key_for(len(plans)), current))
            current, size = [], 0

    for p in pieces:
        n = p.data.nbytes
        if n == 0:
            continue
        if n > object_size:
            close()
            for start in range(0, n, step):
                chunk = p.data[start : start + step]
                plans.append(ObjectPlan(key_for(len(plans)), [PlannedExtent(p.item, p.shard, start, 0, chunk)]))
            continue
        if size and size + n > object_size:
            close()
        if align > 1 and n >= align and size % align:
            size += align - size % align  # small pieces stay packed tight; big ones start aligned
        current.append(PlannedExtent(p.item, p.shard, 0, size, p.data))
        size += n
    close()
    return plans
