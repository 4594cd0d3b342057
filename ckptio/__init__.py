"""ckptio: a fast, crash-safe storage layer for sharded ML checkpoints.

>>> h = ckptio.save("/mnt/ssd/run1", state, step=100)   # returns once staged
>>> h.result()                                          # written and committed
>>> state = ckptio.restore("/mnt/ssd/run1")             # newest committed step
>>> state = ckptio.restore("/mnt/ssd/run1", target=ckptio.restore_target(state))  # its types and shardings
"""

from __future__ import annotations

from ckptio.api import restore, save
from ckptio.coord.waits import CollectiveTimeout
from ckptio.engine import EngineConfig, Progress
from ckptio.engine.layout import FanoutNaming, FlatNaming, HashedNaming, Naming
from ckptio.errors import (
    CheckpointNotFoundError, CkptioError, IntegrityError, ManifestError, SaveFailedError, StepBusyError,
    UnsupportedLeafError,
)
from ckptio.manage.manager import CheckpointManager
from ckptio.restoring.from_state import restore_target
from ckptio.saving.job import SaveHandle
from ckptio.saving.options import SaveOptions
from ckptio.saving.savestate import SaveState
from ckptio.state.leaves import Sharded
from ckptio.state.perhost import PerHost
from ckptio.system.bufferpool import StagingPool

__all__ = [
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptioError",
    "CollectiveTimeout",
    "EngineConfig",
    "FanoutNaming",
    "FlatNaming",
    "HashedNaming",
    "IntegrityError",
    "ManifestError",
    "Naming",
    "PerHost",
    "Progress",
    "SaveFailedError",
    "SaveHandle",
    "SaveOptions",
    "SaveState",
    "Sharded",
    "StagingPool",
    "StepBusyError",
    "UnsupportedLeafError",
    "restore",
    "restore_target",
    "save",
    "zarr_store",
]

__version__ = "0.1.0"


def zarr_store(url: str, step: int | None = None, **options: object) -> object:
    """A read-only zarr v3 store over a committed checkpoint (needs the ``zarr`` extra).

    See :mod:`ckptio.convert.zarr_view`.
    """
    from ckptio.convert.zarr_view import zarr_store as _zarr_store

    return _zarr_store(url, step, **options)
