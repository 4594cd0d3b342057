"""Storage backends: one module per kind of storage, picked by URL scheme.

Third parties add a backend through the ``ckptio.backends`` entry-point
group: the entry point's name is the URL scheme, its value the Backend class.
"""

from __future__ import annotations

import functools
import importlib
import os
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, LayoutDefaults, ObjectInfo, RetryableError, ThrottledError, check_key,
    join_key,
)

__all__ = [
    "Backend",
    "ByteRange",
    "Capabilities",
    "LayoutDefaults",
    "ObjectInfo",
    "RetryableError",
    "ThrottledError",
    "check_key",
    "detect_scheme",
    "join_key",
    "open_backend",
    "split_url",
]

# The one table of built-in URL schemes (Backend classes do not repeat them), resolved lazily
# so that importing ckptio never imports aiohttp.
_BUILTIN: dict[str, str] = {
    "": "ckptio.backends.local:LocalBackend",
    "file": "ckptio.backends.local:LocalBackend",
    "mem": "ckptio.backends.memory:MemoryBackend",
    "memory": "ckptio.backends.memory:MemoryBackend",
    "gs": "ckptio.backends.gcs:GCSBackend",
    "hdml": "ckptio.backends.hyperdisk_ml:HyperdiskMLBackend",
    "pstore": "ckptio.backends.parallelstore:ParallelstoreBackend",
    # Every fsspec protocol: "fsspec+s3", "fsspec+gs", ... resolve here (see backend_class).
    "fsspec": "ckptio.backends.fsspec_backend:FsspecBackend",
}


def split_url(url: str) -> tuple[str, str]:
    """``"gs://b/p"`` -> ``("gs", "b/p")``; a plain path -> ``("", path)``."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    return "", url


def _load(spec: str) -> type[Backend]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@functools.lru_cache(maxsize=1)
def _plugins() -> tuple[EntryPoint, ...]:
    """The ``ckptio.backends`` entry points, found once per process.

    Finding them reads every installed distribution's metadata: ~35 ms per store opened
    (a restore opens one) with a cold page cache, on a venv of 140 distributions (issue 17).
    A backend package installed while the process runs is seen by the next process.
    """
    return tuple(entry_points(group="ckptio.backends"))


def backend_class(scheme: str) -> type[Backend]:
    """The Backend class serving ``scheme``; entry points may add or override schemes."""
    for ep in _plugins():
        if ep.name == scheme and ep.value != _BUILTIN.get(scheme):
            return ep.load()
    if scheme in _BUILTIN:
        return _load(_BUILTIN[scheme])
    if scheme.startswith("fsspec+"):  # one backend serves every fsspec protocol
        return backend_class("fsspec")
    known = sorted({*_BUILTIN, *(ep.name for ep in _plugins())} - {""})
    known = [f"{k}+<protocol>" if k == "fsspec" else k for k in known]
    raise ValueError(f"no ckptio backend for URL scheme {scheme!r}; known schemes: {', '.join(known)}")


def detect_scheme(path: str, mountinfo: str | None = None) -> str:
    """The POSIX flavour a plain path's mount calls for: ``pstore`` on dfuse, ``hdml`` on a
    read-only mount (a many-readers attachment), else ``file``."""
    from ckptio.backends._mounts import MOUNTINFO, find_mount
    from ckptio.backends.parallelstore import is_dfuse

    mount = find_mount(path, mountinfo or MOUNTINFO)
    if is_dfuse(mount):
        return "pstore"
    if mount is not None and mount.read_only:
        return "hdml"
    return "file"


def open_backend(url: str | os.PathLike[str], **options: Any) -> Backend:
    """Create the backend for ``url``.

    A plain path is auto-detected from its mount (see :func:`detect_scheme`);
    ``file://``, ``hdml://``, ``pstore://`` pick a POSIX flavour explicitly.
    """
    url = os.fspath(url)
    scheme, _ = split_url(url)
    if scheme == "":
        scheme = detect_scheme(url)
    return backend_class(scheme)(url, **options)
