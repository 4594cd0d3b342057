"""ckptio's own exception classes. Storage errors are builtins (see ckptio.backends.base)."""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "CkptioError",
    "IntegrityError",
    "ManifestError",
    "SaveFailedError",
    "SaveRevokedError",
    "StepBusyError",
    "UnconfirmedCommitError",
    "UnsupportedLeafError",
]


class CkptioError(Exception):
    """Base class of ckptio's own errors."""


class IntegrityError(CkptioError):
    """Bytes read back do not match their checksum: the object is corrupt; nothing is returned."""

    # ``key`` has a default only so that the exception pickles (BaseException re-creates it
    # from ``args`` and then restores ``__dict__``): DCP gathers a rank's exception to rank 0.
    def __init__(self, message: str, *, key: str = "", item: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.item = item


class ManifestError(CkptioError, ValueError):
    """A manifest is malformed, from an unsupported version, or names something it may not."""


class CheckpointNotFoundError(CkptioError, FileNotFoundError):
    """No committed checkpoint at the given URL / step."""


class UnsupportedLeafError(CkptioError, TypeError):
    """A leaf of the state cannot be saved without pickle (names its pytree path)."""


class SaveFailedError(CkptioError):
    """A save did not commit (on this host or another); the previous checkpoints are untouched."""


class SaveRevokedError(SaveFailedError):
    """A save stalled past its lease and a deleter revoked it: it rolled its commit back (ckptio.store.fence)."""


class UnconfirmedCommitError(CheckpointNotFoundError):
    """A manifest whose fence does not say "commit": its commit is in flight, died, or was revoked.

    ``manifest``: the (validated) manifest; ``outcome``: what its fence says (None: unclaimed).
    """

    def __init__(self, message: str, *, manifest: object = None, outcome: bytes | None = None) -> None:
        super().__init__(message)
        self.manifest = manifest
        self.outcome = outcome


class StepBusyError(CkptioError, FileExistsError):
    """A step holds the manifest of another save whose commit is not confirmed, and that save may be alive.

    Raised where a save of the step cannot wait for that save's lease to end (see
    :mod:`ckptio.store.resave`). ``manifest``: the other save's manifest (None if unknown).
    Not a caller's mistake: ``CheckpointManager(on_save_error="warn")`` counts it as a failed save.
    """

    def __init__(self, message: str, *, manifest: object = None) -> None:
        super().__init__(message)
        self.manifest = manifest
