"""The base of every wrapper backend: it delegates each call to the backend it wraps.

Subclasses (:mod:`ckptio.backends.wrappers`, :mod:`.retrying`, :mod:`.deadline`, :mod:`.budget`,
:mod:`.stalling`, tests' own) override the calls they change and inherit the rest, so a method
added to the contract (``delete_if``) passes through every wrapper that does not change it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, Filling, LayoutDefaults, ObjectInfo, Read, own_read_into,
)

__all__ = ["METHODS", "WrapperBackend"]


#: The backend methods a wrapper intercepts (``read`` goes through ``stat`` + ``read_into``).
METHODS: tuple[str, ...] = (
    "write",
    "read_into",
    "create_if_absent",
    "delete",
    "delete_if",
    "stat",
    "list",
    "list_children",
    "sync",
)


def _passes(cls: type, changed: str, passer: str) -> bool:
    """Whether no class in ``cls``'s MRO changed ``changed`` after the one that last defined ``passer``.

    By MRO, not issubclass(): ABCMeta has not set ``cls`` up yet while ``__init_subclass__`` runs.
    """
    owner = {name: next(c for c in cls.__mro__ if name in vars(c)) for name in (changed, passer)}
    return owner[changed] in owner[passer].__mro__


class WrapperBackend(Backend):
    """Delegates every call to ``inner``; subclasses override the calls they change.

    ``read`` is deliberately not delegated: the inherited implementation calls
    this wrapper's ``stat`` and ``read_into``, so faults, latency and counting
    apply to whole-object reads as well.
    """

    #: Whether this class's ``delete_if`` does to a conditional delete what its ``delete`` does to a
    #: delete: no class changed ``delete`` after the one that last defined ``delete_if`` (per class).
    _wraps_delete_if: ClassVar[bool] = True
    #: Whether this class passes a :meth:`read_many` on to ``inner`` as one call: no class changed
    #: ``read_into`` after the one that last defined ``read_many`` (per class). Else each read of a
    #: batch goes through this wrapper's own ``read_into`` (its faults, counts, budget).
    _passes_read_many: ClassVar[bool] = True
    #: Whether this class passes a :meth:`write_filling` on to ``inner``: no class changed ``write``
    #: after the one that last defined ``write_filling``. Else it waits for the fill, then goes
    #: through this wrapper's own ``write`` (its faults, counts, budget).
    _passes_write_filling: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._wraps_delete_if = _passes(cls, "delete", "delete_if")
        cls._passes_read_many = _passes(cls, "read_into", "read_many")
        cls._passes_write_filling = _passes(cls, "write", "write_filling")

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    @property  # type: ignore[override]
    def capabilities(self) -> Capabilities:
        caps = self.inner.capabilities
        if caps.conditional_delete and not self._wraps_delete_if:
            # A wrapper that changes delete (a fault, a pause, a log) but says nothing of delete_if would
            # let conditional deletes bypass it: it offers none, and deleters fall back to delete.
            return dataclasses.replace(caps, conditional_delete=False)
        return caps

    @property  # type: ignore[override]
    def layout_defaults(self) -> LayoutDefaults:
        return self.inner.layout_defaults

    @property
    def url(self) -> str:
        return self.inner.url

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        await self.inner.write(key, buffers)

    async def write_filling(self, key: str, buffers: Sequence[memoryview], filling: Filling) -> None:
        if self._passes_write_filling:
            await self.inner.write_filling(key, buffers, filling)
        else:
            await super().write_filling(key, buffers, filling)

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        await self.inner.read_into(key, rng, buffers)

    @property  # type: ignore[override]
    def batches_reads(self) -> bool:
        # An instance's own read_into (a test's or a bench's counter set on it) sees every read too.
        return self._passes_read_many and not own_read_into(self) and self.inner.batches_reads

    async def read_many(self, reads: Sequence[Read]) -> None:
        if self.batches_reads:
            await self.inner.read_many(reads)
        else:
            await super().read_many(reads)

    async def create_if_absent(self, key: str, data: bytes) -> None:
        await self.inner.create_if_absent(key, data)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_if(self, key: str, version: str) -> bool:
        return await self.inner.delete_if(key, version)

    async def stat(self, key: str) -> ObjectInfo:
        return await self.inner.stat(key)

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self.inner.list(prefix)

    async def list_children(self, prefix: str = "") -> list[str]:
        return await self.inner.list_children(prefix)

    async def sync(self) -> None:
        await self.inner.sync()

    async def sweep_temporaries(
        self, older_than_s: float, *, dry_run: bool = False, prefix: str | None = None
    ) -> list[str]:
        # A prefix comes only where the inner backend declares Capabilities.sweeps_by_prefix
        # (this wrapper declares what it wraps), so only then does it travel on.
        if prefix is None:
            return await self.inner.sweep_temporaries(older_than_s, dry_run=dry_run)
        sweep: Any = self.inner.sweep_temporaries  # typed without ``prefix`` in the Backend ABC
        return await sweep(older_than_s, dry_run=dry_run, prefix=prefix)

    async def close(self) -> None:
        await self.inner.close()

    async def close_loop(self) -> None:
        await self.inner.close_loop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"
