"""The native API: ``ckptio.save`` and ``ckptio.restore``."""

from __future__ import annotations

import os
from typing import Any

from ckptio.backends import Backend
from ckptio.coord.distributed import Coordinator, config_for_host, default_coordinator
from ckptio.engine import EngineConfig, Progress, run_sync
from ckptio.engine.layout import Naming
from ckptio.engine.progressbar import progress_callback
from ckptio.restoring import restore_step
from ckptio.saving.options import SaveOptions
from ckptio.saving.job import SaveHandle, start_save
from ckptio.store import CheckpointStore, StoreOptions
from ckptio.store.urls import file_in_the_way
from ckptio.system.bufferpool import StagingPool, process_pool

__all__ = ["restore", "save"]


def save(
    url: str | os.PathLike[str],
    state: Any,
    step: int | None = None,
    *,
    metadata: dict[str, Any] | None = None,
    coordinator: Coordinator | None = None,
    copy: bool = True,
    engine_config: EngineConfig | None = None,
    naming: Naming | None = None,
    backend_options: dict[str, Any] | None = None,
    progress: Progress | bool | None = None,
    pool: StagingPool | None = None,
    backend: Backend | None = None,
    save_options: SaveOptions | None = None,
) -> SaveHandle:
    """Save ``state`` (a pytree: see :mod:`ckptio.state.tree`) as step ``step`` under ``url``.

    Returns once the state is staged (the training step may go on and mutate
    its arrays); ``.result()`` waits until every host's objects are written
    and the manifest is committed. With ``step=None`` the checkpoint is
    ``url`` itself. In a multi-process job (torch.distributed or
    jax.distributed initialized) every process calls ``save``; each writes
    only its own shards and process 0 commits.

    ``copy=False`` skips the staging copy of mutable arrays: only for callers
    that promise not to mutate them until ``.result()`` returns. ``backend``
    overrides the backend ``url`` would pick (e.g. a wrapped one).
    ``progress=True`` shows a tqdm bar of the bytes written; a callable
    ``(event, nbytes)`` is called as bytes go out (``event``: ``"written"``).
    ``pool``: the host buffers the state is staged into, kept for the next save; without one,
    a save staged in this process uses :func:`ckptio.system.bufferpool.process_pool` (at most 1 GiB
    kept between saves; the writer process keeps its own). ``save_options``: who writes the objects,
    tiling, the switch interval (:class:`~ckptio.saving.options.SaveOptions`).
    """
    problem = file_in_the_way(url) if backend is None else None
    if problem:
        raise NotADirectoryError(problem)
    store = CheckpointStore(StoreOptions(
        os.fspath(url), backend=backend, engine_config=config_for_host(engine_config, coordinator), naming=naming,
        backend_options=backend_options,
    ))
    callback, close_bar = progress_callback(progress, "save")

    def done(_h: SaveHandle) -> None:
        close_bar()
        run_sync(store.close())

    try:
        return start_save(
            store, step, state, metadata=metadata, coordinator=coordinator or default_coordinator(),
            copy=copy, progress=callback, pool=process_pool() if pool is None else pool, on_done=done,
            options=save_options,
        )
    except BaseException:
        close_bar()
        raise


def restore(
    url: str | os.PathLike[str],
    step: int | None = None,
    target: Any = None,
    *,
    engine_config: EngineConfig | None = None,
    backend_options: dict[str, Any] | None = None,
    progress: Progress | bool | None = None,
    backend: Backend | None = None,
    coordinator: Coordinator | None = None,
    read_once: bool | str = False,
) -> Any:
    """Restore step ``step`` (default: the newest committed) from ``url``.

    ``target`` is a pytree like the saved one whose leaves say what to read
    and in which layout (see :mod:`ckptio.restore`); by default every item is
    restored whole, as numpy arrays and Python values. Every byte read is
    checked against its crc32c; a mismatch raises IntegrityError naming the
    object and the item, and nothing is returned. A target leaf of another
    dtype is a checked cast; ``progress=True`` shows a tqdm bar of the bytes read, a callable
    ``(event, nbytes)`` is called as bytes come in (``event``: ``"read"``).

    ``read_once=True`` (a multi-process job; every process passes it; ``"exchange"`` is the
    same): each stored byte some process needs is read from storage by one process and sent to
    the others that need it over ``coordinator`` (default: torch.distributed's or
    jax.distributed's, see :func:`ckptio.coord.distributed.default_coordinator`), by logical-box
    exchange (each process reads the manifest's root and the fragments it sends from;
    :mod:`ckptio.restoring.boxexchange`); arrays no two processes share (same layout, fewer or
    more processes along the rows) each process reads itself. Every byte is verified against
    its checksum by the process that reads it. With a coordinator that cannot exchange bytes,
    every process reads what it needs.
    """
    store = CheckpointStore(StoreOptions(os.fspath(url), backend=backend,
                                         engine_config=config_for_host(engine_config, coordinator),
                                         backend_options=backend_options))
    callback, close_bar = progress_callback(progress, "restore")
    if read_once and coordinator is None:
        coordinator = default_coordinator()
    try:
        return restore_step(store, step, target, progress=callback, coordinator=coordinator, read_once=read_once)
    finally:
        close_bar()
        run_sync(store.close())
