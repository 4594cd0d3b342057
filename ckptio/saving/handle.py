"""A save as its caller sees it: :class:`SaveHandle`, the save in flight (``ckptio.save`` returns it
once staged). The options it runs with are :class:`ckptio.saving.options.SaveOptions`; the save job
itself is :class:`ckptio.saving.job.SaveJob`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from ckptio.manifest import Manifest
from ckptio.saving.savestate import SaveState

__all__ = ["SaveHandle"]


class SaveHandle:
    """A save in flight. Returned once staged; :meth:`result` waits until committed."""

    def __init__(self, url: str, step: int | None) -> None:
        self.url = url
        self.step = step
        self.state = SaveState.STAGED
        self.stage_seconds = 0.0
        #: A save by many hosts to a host-local store (ckptio.saving.carried_fragments): this host's own part
        #: (``objects``, ``sizes``, ``extents``) and, on the coordinator, each host's fragment base
        #: (its objects' first index in the checkpoint; -1: no fragment). The tiers' commit records.
        self.part: dict[str, Any] | None = None
        self.part_bases: list[int] | None = None
        #: A multi-host incremental save: this host's own part of the step, its next save's base
        #: (ckptio.saving.incremental.hosts.own_base).
        self.own_base: Manifest | None = None
        self._future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> Manifest | None:
        """Wait until the checkpoint is committed; raise if the save failed (on any host).

        Returns the manifest on the coordinator (rank 0), None on other hosts.
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def resolve(self, manifest: Manifest | None, error: BaseException | None) -> None:
        """End the save: :meth:`result` returns ``manifest``, or raises ``error`` when given."""
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(manifest)

    def __repr__(self) -> str:
        return f"SaveHandle({self.url!r}, step={self.step}, state={self.state})"
