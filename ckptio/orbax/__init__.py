"""ckptio as Orbax's storage layer.

>>> import ckptio.orbax
>>> mngr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=3))
>>> mngr.save(step, args=ckptio.orbax.Save(state))
>>> state = mngr.restore(step, args=ckptio.orbax.Restore(abstract_state))

Also inside ``ocp.args.Composite(state=ckptio.orbax.Save(...), extra=ocp.args.JsonSave(...))``.

* :class:`Save` / :class:`Restore` are registered with :class:`CkptioCheckpointHandler`
  (importing this module registers them). By default the data lives inside
  Orbax's item directory, so Orbax's commit and retention cover it.
* External storage with hashed object names (``gs://bucket/run1``):
  :class:`CheckpointManager` (``storage=..., naming=HashedNaming()``), or a
  registry from :func:`handler_registry` plus :func:`attach` on any manager;
  retention then deletes ckptio's objects with each step.
* :func:`register` routes the ``jax.Array`` leaves of Orbax's own
  ``StandardSave`` / ``PyTreeSave`` through ckptio (:class:`CkptioArrayHandler`).
"""

from __future__ import annotations

from ckptio.orbax._io import POINTER_NAME, StorageConfig, sweep_external
from ckptio.orbax.handler import CkptioCheckpointHandler, Restore, Save, handler_registry
from ckptio.orbax.retention import CheckpointManager, CkptioDeleter, attach
from ckptio.orbax.type_handler import TYPESTR, CkptioArrayHandler, register, unregister

__all__ = [
    "POINTER_NAME",
    "TYPESTR",
    "CheckpointManager",
    "CkptioArrayHandler",
    "CkptioCheckpointHandler",
    "CkptioDeleter",
    "Restore",
    "Save",
    "StorageConfig",
    "attach",
    "handler_registry",
    "register",
    "sweep_external",
    "unregister",
]
