"""``ckptio.CheckpointManager``: periodic saves with retention, like Orbax's.

One save in flight at a time (a new save waits for the previous one);
staging buffers are reused between saves; retention runs on the coordinator
after each commit and deletes by manifest (see :mod:`ckptio.store`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ckptio.backends import Backend

from .distributed import Coordinator, default_coordinator
from . import sidecar
from .engine import EngineConfig, Progress, run_sync
from .layout import Naming
from .restore import restore_step
from .save import SaveHandle, start_save
from .staging import StagingPool
from .store import CheckpointStore
from .urls import file_in_the_way

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptio.manager")


class CheckpointManager:
    """Saves steps under one root URL and keeps the ones retention asks for.

    Args:
        url: root URL or path; step ``s`` lives in ``<url>/<s>``.
        max_to_keep: keep at most this many newest checkpoints (None: all),
            not counting those kept by ``keep_period``.
        keep_period: also keep every step divisible by this, forever.
        save_interval_steps: :meth:`should_save` is true every this many steps.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        save_interval_steps: int = 1,
        coordinator: Coordinator | None = None,
        engine_config: EngineConfig | None = None,
        naming: Naming | None = None,
        backend_options: dict[str, Any] | None = None,
        backend: Backend | None = None,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if keep_period is not None and keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {keep_period}")
        # The same refusal as ckptio.save: a root that is a file would otherwise fail later, at the
        # first save, as a bare "no such file" deep in the backend.
        problem = file_in_the_way(url) if backend is None else None
        if problem:
            raise NotADirectoryError(problem)
        self.store = CheckpointStore(
            url, backend=backend, engine_config=engine_config, naming=naming, backend_options=backend_options
        )
        self.url = self.store.url
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.save_interval_steps = max(1, save_interval_steps)
        self.coordinator = coordinator or default_coordinator()
        self._pool = StagingPool()
        sidecar.prestart(engine_config)  # a writer process, if asked for, is up before the first save
        self._pending: SaveHandle | None = None
        self._lock = threading.Lock()
        self._retention_error: BaseException | None = None

    # -- queries ---------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""
        return run_sync(self.store.committed_steps())

    def latest_step(self) -> int | None:
        """The newest committed step whose manifest is intact (a damaged newer one is logged and skipped)."""
        steps = run_sync(self.store.intact_steps(newest=1))
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """True if ``step`` is on the save interval and newer than the latest committed step."""
        latest = self.latest_step()
        return step % self.save_interval_steps == 0 and (latest is None or step > latest)

    # -- save / restore --------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metadata: dict[str, Any] | None = None,
        force: bool = False,
        progress: Progress | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` as ``step`` unless :meth:`should_save` says no (``force`` overrides).

        Waits for the previous save to commit first, then returns once staged.
        """
        self.wait_until_finished()
        if not force and not self.should_save(step):
            log.info("%s: step %d not saved (off the save interval, or not newer than the latest step %s)",
                     self.url, step, self.latest_step())
            return None
        if force and self.max_to_keep is not None and step in self._doomed(
            sorted({*run_sync(self.store.intact_steps(newest=self.max_to_keep)), step})
        ):
            log.warning("%s: forced save of step %d: retention (max_to_keep=%d) deletes it right after its "
                        "commit, since %d newer steps exist", self.url, step, self.max_to_keep, self.max_to_keep)
        handle = start_save(
            self.store, step, state, metadata=metadata, coordinator=self.coordinator, pool=self._pool,
            progress=progress, on_done=self._after_save,
        )
        self._pending = handle
        return handle

    def _after_save(self, handle: SaveHandle) -> None:
        if handle.state.value != "committed" or self.coordinator.rank != 0 or self.max_to_keep is None:
            return  # nothing to delete: no manifest is read (a keep-everything run keeps thousands)
        try:
            for step in run_sync(self._retention_victims(self.max_to_keep)):
                run_sync(self.store.delete(str(step)))
        except BaseException as e:  # surfaced by wait_until_finished; the checkpoint itself is fine
            log.error("%s: retention failed: %r", self.url, e)
            self._retention_error = e

    async def _retention_victims(self, keep: int) -> list[int]:
        """:meth:`_doomed` of every intact step, reading only the manifests that can matter.

        Only intact steps count as kept, and only intact steps are deleted: a damaged step
        never makes retention delete a good one, and is left for inspection. The newest
        ``keep`` intact steps stay; of the older directories, periodic steps stay without
        their manifests being read, and the rest are deleted if intact.
        """
        dirs = await self.store.step_dirs()
        # A kept step must be whole (a listing per step): a newer step that lost an object must not
        # count, or retention would delete the older step a restore then needs.
        kept = await self.store.intact_steps(newest=keep, among=dirs, whole=True)
        if len(kept) < keep:
            return []
        older = [s for s in dirs if s < kept[0] and not self._periodic(s)]
        return await self.store.intact_steps(among=older) if older else []

    def _periodic(self, step: int) -> bool:
        return bool(self.keep_period) and step % self.keep_period == 0

    def _doomed(self, steps: list[int]) -> list[int]:
        """Steps retention deletes: beyond the newest ``max_to_keep``, unless kept by ``keep_period``."""
        if self.max_to_keep is None:
            return []
        periodic = {s for s in steps if self._periodic(s)}
        others = [s for s in steps if s not in periodic]
        newest = set(steps[-self.max_to_keep :])
        return [s for s in others if s not in newest]

    def wait_until_finished(self) -> None:
        """Wait for the save in flight to commit (and its retention to run); re-raise its failure."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.result()
        if self._retention_error is not None:
            err, self._retention_error = self._retention_error, None
            raise err

    def restore(self, step: int | None = None, target: Any = None, *, progress: Progress | None = None) -> Any:
        """Restore ``step`` (default: the newest restorable committed) as ``target`` asks (see
        ``ckptio.restore``); with several hosts, every host must call it (one collective decision)."""
        return restore_step(self.store, step, target, progress=progress, coordinator=self.coordinator)

    def delete(self, step: int) -> None:
        """Delete one committed checkpoint (coordinator only)."""
        run_sync(self.store.delete(str(step)))

    def sweep_orphans(self, grace_seconds: float = 3600.0, *, dry_run: bool = False) -> list[str]:
        """Delete what crashed saves left (see :meth:`CheckpointStore.sweep`); returns the keys deleted."""
        return run_sync(self.store.sweep(grace_seconds, dry_run=dry_run)).deleted

    def close(self) -> None:
        self.wait_until_finished()
        self._pool.clear()
        run_sync(self.store.close())

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
