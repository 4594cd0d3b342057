"""Hyperdisk ML: a block volume written by one host, then attached read-only to many.

Why these defaults:

* Reads dominate (many hosts restore the same checkpoint at once), so reads
  are large (objects of 256 MiB, 32 MiB read requests), many in flight (32
  threads: Hyperdisk ML throughput scales with outstanding IO), and hinted
  to the kernel (``posix_fadvise`` SEQUENTIAL + WILLNEED) so readahead runs
  ahead of the preads.
* A read-only attachment is detected from the mount (``ro`` in
  /proc/self/mountinfo, or ``ST_RDONLY`` from statvfs) and declared in the
  capabilities; every write is refused with an error that explains the
  single-writer phase, instead of failing with EROFS deep in a save.
* The writer phase ends with :func:`ckptio.manage.hdml_publish.publish`: re-read and
  verify every checksum, fsync everything, and mark the checkpoint published,
  before the volume is re-attached read-only to the readers. It lives above
  the backends (it verifies through the manifest and the store); this module
  keeps the marker's name and :func:`is_published`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptio.backends._mounts import MOUNTINFO, find_mount
from ckptio.backends.base import Capabilities, LayoutDefaults
from ckptio.backends.local import LocalBackend, LocalConfig

__all__ = ["PUBLISHED_NAME", "HyperdiskMLBackend", "is_published", "published_key"]

PUBLISHED_NAME = "ckptio.published"

HYPERDISK_ML_DEFAULTS = LocalConfig(threads=32, object_size=256 << 20, readahead_hint=True)


class HyperdiskMLBackend(LocalBackend):
    """``hdml:///mnt/hdml/run1``: the local backend with read-optimised defaults and RO detection."""

    def __init__(
        self, url: str, config: LocalConfig | None = None, *, mountinfo: str = MOUNTINFO, **options: Any
    ) -> None:
        self._mountinfo = mountinfo
        super().__init__(url, config or HYPERDISK_ML_DEFAULTS, **options)

    def detect_read_only(self) -> bool:
        """True when the volume is attached/mounted read-only (the many-readers phase)."""
        mount = find_mount(self.root, self._mountinfo)
        if mount is not None and mount.read_only:
            return True
        probe = self.root
        while not os.path.exists(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)
        try:
            return bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def _capabilities(self) -> Capabilities:
        caps = super()._capabilities()
        return dataclasses.replace(caps, read_only=self.detect_read_only(), preferred_io_size=32 << 20)

    def _layout_defaults(self) -> LayoutDefaults:
        # Attached read-only to many hosts to restore from: tiled, so each reads only its part.
        return dataclasses.replace(super()._layout_defaults(), tile_bytes=1 << 20)

    def read_only_message(self, key: str) -> str:
        if not self.url.startswith("hdml://"):
            # A plain path on a read-only mount gets this backend too (auto-detected), and most such
            # mounts are no Hyperdisk ML volume: name Hyperdisk ML only when the URL says it is one.
            return f"{self.url}: cannot modify {key!r}: the file system at {self.root} is mounted read-only"
        return (
            f"{self.url}: cannot modify {key!r}: this Hyperdisk ML volume is attached read-only. "
            "Hyperdisk ML is written in a single-writer phase (one host, read-write attachment; "
            "finish with ckptio.manage.hdml_publish.publish), then attached read-only to many readers."
        )


def published_key(step_dir: str) -> str:
    """The key of ``step_dir``'s published marker."""
    return f"{step_dir}/{PUBLISHED_NAME}" if step_dir else PUBLISHED_NAME


async def is_published(backend: LocalBackend, step_dir: str) -> bool:
    """Whether the writer phase of ``step_dir`` ended with :func:`ckptio.manage.hdml_publish.publish`."""
    try:
        await backend.stat(published_key(step_dir))
        return True
    except FileNotFoundError:
        return False

