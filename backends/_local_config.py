"""Options of the POSIX backends (local, Hyperdisk ML, Parallelstore): one picklable dataclass.

Each option says why its default is what it is; the flavours start from their own
defaults (``HYPERDISK_ML_DEFAULTS``, ``PARALLELSTORE_DEFAULTS``).
"""

from __future__ import annotations

import dataclasses

from ckptio.backends._bounce import BOUNCE_BYTES

__all__ = ["LocalConfig"]

#: The largest alignment a direct write can keep: a bounce buffer's size (a larger one would cut
#: every bounce copy to nothing, and the write would never end).
_MAX_ALIGNMENT = BOUNCE_BYTES


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    """Options of the POSIX backends (picklable)."""

    #: Bypass the page cache with O_DIRECT for the aligned bulk of IO of 1 MiB or more: on a
    #: 2-core host, copying through the page cache costs more CPU than the disk takes time.
    #: Falls back to buffered IO by itself where the file system refuses O_DIRECT.
    direct: bool = True
    #: O_DIRECT also for an object whose bytes mostly must pass through a bounce buffer first: memory
    #: out of step with its offset in the file (torch's and numpy's own allocations are 16-64 bytes
    #: into a page; ``ckptio.engine.layout.direct_offset`` lays large ones out in step, where only their
    #: partial pages are bounced). False: such an object is written through the page cache and
    #: fsync'd, as stock DCP writes: the kernel's copy replaces the bounce copy, and writeback sends
    #: large requests from a deep queue where each direct write waits for the device.
    #: ``ckptio.dcp.Writer`` sets it False (issue 35).
    direct_unaligned: bool = True
    #: fsync each file before its rename (and directories in ``sync``).
    fsync: bool = True
    #: Worker threads, i.e. requests in flight (8 with O_DIRECT writes measured 1.6 GiB/s here,
    #: as 4 did within noise; 8 restores a little faster).
    threads: int = 8
    #: Target object size for the layout.
    object_size: int = 64 << 20
    #: O_DIRECT's alignment of offsets, lengths and memory: a power of two, at most one bounce
    #: buffer (:data:`ckptio.backends._bounce.BOUNCE_BYTES`), which unaligned bytes pass through.
    alignment: int = 4096
    #: O_DIRECT for reads too (aligned destinations only). Off by default: measured here, a cold
    #: 1 GiB restore in a fresh process took 0.61-0.64 s buffered (the kernel's readahead) and
    #: 0.80-1.0 s direct, at any piece size (4-64 MiB) or thread count (8-32). Direct reads need
    #: half the fresh memory (no page cache), which halves system time where the VM backs guest
    #: memory lazily (0.5 s vs 1.0-1.6 s per GiB in ``ckptio bench``), but did not win wall time.
    direct_reads: bool = False
    #: posix_fadvise(SEQUENTIAL/WILLNEED) before large reads. Off by default: on this disk a cold
    #: 1 GiB restore measured 1.3x faster without it, with ~20 % less system time (issue 17;
    #: WILLNEED makes the reading thread submit its piece's readahead itself, on top of the
    #: kernel's own). Hyperdisk ML, a network block device, keeps it on.
    readahead_hint: bool = False
    #: fsync directories after creating entries (not needed where metadata is synchronous, e.g. dfuse).
    dir_fsync: bool = True
    #: Commit with link(2) (atomic no-replace). File systems without hard links use an
    #: O_EXCL lock file plus rename instead.
    link_commit: bool = True
    #: Lock-and-rename commits only: a lock this old with no object beside it is a crashed
    #: committer's, and the next committer takes it over (a commit holds it for milliseconds).
    lock_stale_s: float = 600.0
    #: Split a checkpoint's objects over this many sub-directories (0: flat).
    dir_fanout: int = 0
    #: See :attr:`LayoutDefaults.tile_bytes` (0: plain C order, the right default for a local disk).
    tile_bytes: int = 0
    #: Object writes run on threads this many nice steps below the caller's priority, so
    #: that a background save's copies and system calls yield the CPU to the training
    #: step (see :mod:`ckptio.system.threads`). Off by default: on a CPU-saturated 2-core host
    #: nice 10 cut the step's run-queue wait but also the save's throughput (~1.1 -> ~0.75 GiB/s).
    write_nice: int = 0

    def __post_init__(self) -> None:
        a = self.alignment
        if isinstance(a, bool) or not isinstance(a, int) or a < 1 or a & (a - 1) or a > _MAX_ALIGNMENT:
            raise ValueError(f"LocalConfig.alignment must be a power of two from 1 to {_MAX_ALIGNMENT}, got {a!r}")
