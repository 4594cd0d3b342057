"""What a URL names on the local file system, for errors that say what is wrong with a path."""

from __future__ import annotations

import os

__all__ = ["file_in_the_way", "local_path"]

_POSIX_SCHEMES = ("file", "hdml", "pstore")


def local_path(url: str | os.PathLike[str]) -> str | None:
    """The file-system path of a local URL (a plain path, ``file://``, ``hdml://``, ``pstore://``); else None."""
    url = os.fspath(url)
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return rest if scheme.lower() in _POSIX_SCHEMES else None


def file_in_the_way(url: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint cannot live at local ``url`` because it, or a directory above it, is a file."""
    path = local_path(url)
    if not path:
        return None
    probe = os.path.abspath(path)
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.lexists(probe) and not os.path.isdir(probe):
        what = "is a file" if probe == os.path.abspath(path) else f"lies under {probe}, which is a file"
        return f"{os.fspath(url)} {what}, not a directory: a checkpoint root is a directory"
    return None
