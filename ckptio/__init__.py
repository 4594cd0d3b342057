"""ckptio: a fast, crash-safe storage layer for sharded ML checkpoints.

>>> h = ckptio.save("/mnt/ssd/run1", state, step=100)   # returns once staged
>>> h.result()                                          # written and committed
>>> state = ckptio.restore("/mnt/ssd/run1")             # newest committed step
>>> state = ckptio.restore("/mnt/ssd/run1", target=ckptio.restore_target(state))  # its types and shardings
"""

from __future__ import annotations

import sys as _sys

from .api import restore, save
from .engine import EngineConfig, Progress
from .errors import (
    CheckpointNotFoundError,
    CkptioError,
    IntegrityError,
    ManifestError,
    SaveFailedError,
    StepBusyError,
    UnsupportedLeafError,
)
from .layout import FanoutNaming, FlatNaming, HashedNaming, Naming
from .manager import CheckpointManager
from .perhost import PerHost
from .save import SaveHandle
from .staging import Sharded, StagingPool
from .states import SaveState
from .targets import restore_target
from .waits import CollectiveTimeout

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


def _carry_submodules(fn: object, package: str) -> None:
    """Gives the function ``fn``, bound here under the name of the subpackage ``package``, each of
    that package's submodule names as the package holds it.

    ``import ckptio.restore.batches as B`` looks ``batches`` up on the attribute ``ckptio.restore``,
    the function that shadows the subpackage: without these it fails ("cannot import name
    'batches' from 'restore'"). The public function keeps its name and its type; what the import
    now finds is what it would find on the package itself. Every submodule is loaded by then
    (tests/test_user_surface.py holds each to it)."""
    pkg, prefix = _sys.modules[package], package + "."
    for name in [m[len(prefix) :] for m in _sys.modules if m.startswith(prefix)]:
        if "." not in name:
            setattr(fn, name, getattr(pkg, name))


_carry_submodules(restore, __name__ + ".restore")


def zarr_store(url: str, step: int | None = None, **options: object) -> object:
    """A read-only zarr v3 store over a committed checkpoint (needs the ``zarr`` extra).

    See :mod:`ckptio.zarr_view`.
    """
    from .zarr_view import zarr_store as _zarr_store

    return _zarr_store(url, step, **options)
