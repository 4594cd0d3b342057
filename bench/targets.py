"""Where the bench writes: a target hands each case a fresh root and cleans it up.

``LocalTarget`` is a temporary directory on a local disk (the default).
The GCS target is a hook for now: ``--backend gs://…`` will run against a
real endpoint, or start fake-gcs-server itself when none is given (see
``shared/notes/fake-gcs.md``), and add a raw aiohttp PUT/GET ceiling case
(a :class:`~ckptio.bench.cases.Case` with ``schemes = {"gs"}``) against the
same server. To add it: subclass :class:`Target`, set ``scheme = "gs"``,
return ``gs://bucket/prefix/<case>-<n>`` from :meth:`Target.case_root`,
put the emulator's environment (``STORAGE_EMULATOR_HOST``, …) in
:meth:`Target.worker_env`, delete objects in :meth:`Target.cleanup_case`,
stop the server in :meth:`Target.close`, and return it from
:func:`open_target`. Cases whose ``schemes`` lack ``gs`` are skipped there.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Any

from .system import detect_cache_drop

__all__ = ["LocalTarget", "Target", "open_target"]


class Target:
    """Base: one storage location for a whole bench run."""

    scheme = "file"

    def case_root(self, case: str) -> str:
        """A fresh, empty root (path or URL) for one run of ``case``."""
        raise NotImplementedError

    def cleanup_case(self, root: str) -> None:
        """Delete what one case wrote (unless the user asked to keep it)."""

    def worker_env(self) -> dict[str, str]:
        """Extra environment for worker processes (credentials, emulator endpoints)."""
        return {}

    def cache_drop(self) -> tuple[str, str]:
        """(method, reason) for making restores cold on this target."""
        return "none", "not a local disk: nothing to drop"

    def describe(self) -> dict[str, Any]:
        return {"scheme": self.scheme}

    def close(self) -> None:
        """Stop servers and remove the run's scratch space."""


class LocalTarget(Target):
    """A fresh temporary directory under ``parent`` (default: the system temp dir)."""

    scheme = "file"

    def __init__(self, parent: str | None = None, keep: bool = False) -> None:
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.base = tempfile.mkdtemp(prefix="ckptio-bench-", dir=parent)
        self.keep = keep
        self._n = itertools.count()
        self._drop = detect_cache_drop()

    def case_root(self, case: str) -> str:
        root = os.path.join(self.base, f"{case}-{next(self._n)}")
        os.makedirs(root)
        return root

    def cleanup_case(self, root: str) -> None:
        if not self.keep:
            shutil.rmtree(root, ignore_errors=True)

    def cache_drop(self) -> tuple[str, str]:
        return self._drop

    def describe(self) -> dict[str, Any]:
        return {"scheme": "file", "dir": self.base, "kept": self.keep}

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)


def open_target(backend: str | None, keep: bool = False) -> Target:
    """``None`` / a path / ``file://path``: local disk; ``gs://…``: not yet (hook above)."""
    if backend is None or "://" not in backend:
        return LocalTarget(backend, keep=keep)
    scheme, rest = backend.split("://", 1)
    if scheme == "file":
        return LocalTarget(rest or None, keep=keep)
    if scheme == "gs":
        raise NotImplementedError(
            "--backend gs://… is not implemented yet: add a GCS Target in ckptio/bench/targets.py "
            "(fake-gcs-server when no endpoint is given) and a raw aiohttp ceiling case"
        )
    raise ValueError(f"bench has no target for URL scheme {scheme!r} (file://, a path, or gs://)")
