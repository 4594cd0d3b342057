"""Orbax retention that also deletes ckptio's objects outside the step directory.

Orbax's retention (``max_to_keep``, ``keep_period``, ``preservation_policy``)
and ``CheckpointManager.delete`` remove a step by removing its directory.
With data in the item directory (the default layout) that is every byte.
With external storage (hashed object names under another root) it is only
the pointer: the objects would leak. Two mechanisms close that gap:

* :func:`attach` (and :class:`CheckpointManager`, which calls it) wraps the
  manager's ``CheckpointDeleter`` so that deleting a step first deletes the
  external ckptio checkpoint it points to -- at once, in Orbax's own
  deletion path, background deletion included. Orbax 0.12.8 has no public
  way to pass a deleter, so this replaces the manager's private
  ``_checkpoint_deleter`` (checked, with a warning if a later Orbax renames it).
* The handler's sweep after each save and on close (see
  :class:`~ckptio.orbax.CkptioCheckpointHandler`) works with any manager,
  but lags one save behind: Orbax deletes old steps after the handler's
  ``finalize``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from ckptio.engine.layout import Naming
from ckptio.orbax._io import StorageConfig, delete_external
from ckptio.orbax.handler import handler_registry
from ckptio.saving.options import SaveOptions

__all__ = ["CheckpointManager", "CkptioDeleter", "attach"]

log = logging.getLogger("ckptio.orbax")


class CkptioDeleter:
    """An Orbax ``CheckpointDeleter`` that deletes a step's external ckptio checkpoints, then the step.

    ckptio first: its deletion is crash-safe on its own (tombstone, objects,
    manifest), and the pointers that name the data are inside the step
    directory that ``inner`` removes.
    """

    def __init__(
        self,
        inner: Any,
        directory: epath.Path,
        name_format: Any,
        primary_host: int | None,
        config: StorageConfig | None = None,
    ) -> None:
        self._inner = inner
        self._directory = epath.Path(directory)
        self._name_format = name_format
        self._primary_host = primary_host
        self._config = config or StorageConfig()

    def delete(self, step: int) -> None:
        if ocp.multihost.is_primary_host(self._primary_host):
            self._delete_ckptio(step)
        self._inner.delete(step)

    def _delete_ckptio(self, step: int) -> None:
        try:
            path = ocp.path.step.find_step_path(
                self._directory, self._name_format, step=step, include_uncommitted=True
            )
        except ValueError:
            return  # Orbax's deleter will say the step is not there
        for child in path.iterdir():
            try:
                if child.is_dir() and delete_external(child, self._config):
                    log.info("deleted the ckptio checkpoint of %s", child)
            except Exception as e:  # the orphan sweep collects what this misses
                log.warning("ckptio.orbax: deleting the data of %s failed: %r", child, e)

    def delete_steps(self, steps: Sequence[int]) -> None:
        for step in steps:
            self.delete(step)

    def close(self) -> None:
        self._inner.close()


def attach(mngr: ocp.CheckpointManager, *, storage: str | None = None) -> ocp.CheckpointManager:
    """Make ``mngr``'s retention and ``delete`` also delete ckptio's external objects; returns ``mngr``.

    ``storage`` overrides the root recorded in the pointers (a relocated bucket).
    """
    inner = getattr(mngr, "_checkpoint_deleter", None)
    name_format = getattr(mngr, "_step_name_format", None)
    mp = getattr(mngr, "_multiprocessing_options", None)
    if inner is None or name_format is None or mp is None:
        warnings.warn(
            "ckptio.orbax.attach: this Orbax version's CheckpointManager has no _checkpoint_deleter; "
            "external ckptio data of deleted steps is collected by the handler's orphan sweep instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return mngr
    if not isinstance(inner, CkptioDeleter):
        mngr._checkpoint_deleter = CkptioDeleter(
            inner, mngr.directory, name_format, mp.primary_host, StorageConfig(storage)
        )
    return mngr


class CheckpointManager(ocp.CheckpointManager):
    """``ocp.CheckpointManager`` whose retention deletes ckptio's external objects with each step.

    With ``storage`` (and no ``handler_registry``), items saved with
    :class:`ckptio.orbax.Save` store their data under ``storage`` (with
    ``naming``, e.g. :class:`ckptio.engine.layout.HashedNaming`); other items keep
    their usual handlers; ``save_options`` says how their saves run
    (:class:`ckptio.SaveOptions`). Everything else is ``ocp.CheckpointManager``'s.

    Not :class:`ckptio.CheckpointManager`, which shares the name on purpose:
    each is a drop-in for the manager its users already write. This one *is* an
    Orbax manager (a subclass: Orbax's API, options, step directories and
    commit, with ckptio as the storage of ``Save`` items), for code written
    against ``ocp.CheckpointManager``; ``ckptio.CheckpointManager`` is ckptio's
    own, framework-neutral manager (ckptio's commit and retention, no Orbax).
    Import it as ``ckptio.orbax.CheckpointManager`` to keep the two apart.
    """

    def __init__(
        self,
        directory: epath.PathLike,
        options: ocp.CheckpointManagerOptions | None = None,
        *,
        storage: str | None = None,
        naming: Naming | None = None,
        handler_registry: Any = None,
        save_options: SaveOptions | None = None,
        **kwargs: Any,
    ) -> None:
        _check_directory(directory)
        if (storage is not None or save_options is not None) and handler_registry is None:
            handler_registry = _registry(storage, naming=naming, save_options=save_options)
        super().__init__(directory, options=options, handler_registry=handler_registry, **kwargs)
        attach(self, storage=storage)


_registry = handler_registry


def _check_directory(directory: epath.PathLike) -> None:
    """Refuse a root that exists and is not a directory, naming it.

    Orbax accepts such a path and fails only at the first save, inside a
    background thread (``NotADirectoryError: .../0.orbax-checkpoint-tmp``),
    with its signalling threads left waiting.
    """
    path = epath.Path(directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"ckptio.orbax.CheckpointManager: {path} is a file, not a directory; "
            "pass a directory (it is created if missing)"
        )
