"""ckptio: a fast, crash-safe storage layer for sharded ML checkpoints.

>>> h = ckptio.save("/mnt/ssd/run1", state, step=100)   # returns once staged
>>> h.result()                                          # written and committed
>>> state = ckptio.restore("/mnt/ssd/run1")             # newest committed step
"""

from __future__ import annotations

from .api import restore, save
from .engine import EngineConfig
from .errors import (
    CheckpointNotFoundError,
    CkptioError,
    IntegrityError,
    ManifestError,
    SaveFailedError,
    UnsupportedLeafError,
)
from .manager import CheckpointManager
from .save import SaveHandle
from .staging import Sharded, StagingPool
from .states import SaveState

__all__ = [
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptioError",
    "EngineConfig",
    "IntegrityError",
    "ManifestError",
    "SaveFailedError",
    "SaveHandle",
    "SaveState",
    "Sharded",
    "StagingPool",
    "UnsupportedLeafError",
    "restore",
    "save",
]

__version__ = "0.1.0"
