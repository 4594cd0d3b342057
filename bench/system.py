"""What the bench needs from the operating system: cold caches, peak RSS, facts about the machine.

Linux-first; elsewhere every function degrades to "not measured" instead of failing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "PeakRSS",
    "checkpoint_files",
    "current_rss",
    "detect_cache_drop",
    "drop_cache",
    "environment",
    "equalize_memory",
    "resident_fraction",
]

_DROP_CACHES = "/proc/sys/vm/drop_caches"


def detect_cache_drop() -> tuple[str, str]:
    """The strongest cold-cache method permitted here, and why.

    ``drop_caches`` empties the whole page cache (root, writable /proc/sys);
    ``fadvise`` asks the kernel to forget each checkpoint file's pages
    (works unprivileged, but only for files we name and only for clean pages,
    hence the ``os.sync()`` before it); ``none`` when neither exists.
    """
    try:
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
        return "drop_caches", f"writing 3 to {_DROP_CACHES} is permitted"
    except OSError as e:
        reason = f"{_DROP_CACHES}: {e.strerror or e}"
    if hasattr(os, "posix_fadvise"):
        return "fadvise", f"{reason}; using sync + posix_fadvise(POSIX_FADV_DONTNEED) per file"
    return "none", f"{reason}; no posix_fadvise on this platform: restores may read from cache"


def checkpoint_files(root: str | os.PathLike[str]) -> Iterator[Path]:
    """Every regular file under ``root`` (a checkpoint directory)."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath, n)
            if p.is_file() and not p.is_symlink():
                yield p


def drop_cache(method: str, root: str | os.PathLike[str] | None) -> str:
    """Make the next read of ``root``'s files come from the device; returns the method used."""
    if method == "none":
        return "none"
    os.sync()  # dirty pages cannot be dropped: write them back first
    if method == "drop_caches":
        try:
            with open(_DROP_CACHES, "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass  # permission may differ in a child; fall through to per-file advice
    if root is None or not hasattr(os, "posix_fadvise"):
        return "none"
    for p in checkpoint_files(root):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def equalize_memory(nbytes: int) -> dict[str, float]:
    """Touch ``nbytes`` of fresh memory, one write per page, and free it: the restore after this
    finds that much memory freshly backed, whatever the VM did with it before.

    On a VM that hands freed memory back to its host (virtio-balloon free page reporting), the
    first touch of memory the host has taken back costs 3-5 s of system time per GiB against
    ~0.5 s for memory it still backs, and which kind a restore gets is luck (a buffered writer's
    page cache, freed by the cache drop, is memory still backed). Every case, the anchors
    included, calls this before its timed restore, so all start from the same state. Returns
    the seconds and system seconds it took (untimed for the restore).
    """
    import mmap

    import numpy as np

    t0, sys0 = time.perf_counter(), os.times().system
    if nbytes > 0:
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        pages = np.frombuffer(mm, dtype=np.uint8)
        pages[::mmap.PAGESIZE] = 1
        del pages  # the view must go before the mapping can be closed
        mm.close()
    return {"equalize_s": time.perf_counter() - t0, "equalize_sys_s": os.times().system - sys0}


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6", use_errno=True)
    except OSError:
        return None
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return lib


def resident_fraction(root: str | os.PathLike[str], max_files: int = 2048) -> float | None:
    """Fraction of ``root``'s file pages in the page cache (mincore), to prove a drop worked.

    None where mincore is unavailable. Only the first ``max_files`` files are
    looked at, so a 100k-file sweep does not pay 100k mmaps for a check.
    """
    lib = _libc()
    if lib is None or platform.system() != "Linux":
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    prot_read, map_shared = 1, 1
    for i, p in enumerate(checkpoint_files(root)):
        if i >= max_files:
            break
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = lib.mmap(None, size, prot_read, map_shared, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if lib.mincore(addr, size, vec) == 0:
                    total += pages
                    resident += sum(1 for b in bytes(vec) if b & 1)
            finally:
                lib.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def current_rss() -> int | None:
    """This process's resident set size in bytes (None where it cannot be read)."""
    try:
        return _rss_bytes()
    except OSError:
        return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


class PeakRSS:
    """Peak RSS increase over the RSS at ``__enter__``, for everything inside the block.

    Linux lets a process reset its own high-water mark (``5`` into
    ``/proc/self/clear_refs``, since 4.0), after which ``VmHWM`` is exact:
    no sampling thread, no missed short spike. Where that is refused a thread
    samples RSS every ``interval`` seconds (psutil), which can miss spikes
    shorter than the interval; ``method`` says which was used.
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.method = "none"
        self.peak_increase: int | None = None
        self._base = 0
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:  # noqa: PYI034 - typing.Self needs 3.11
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _rss_bytes()
            self.method = "vmhwm"
            return self
        except OSError:
            pass
        try:
            import psutil

            proc = psutil.Process()
            self._base = self._peak = proc.memory_info().rss
            self.method = "psutil-sampling"

            def sample() -> None:
                while not self._stop.wait(self.interval):
                    self._peak = max(self._peak, proc.memory_info().rss)

            self._thread = threading.Thread(target=sample, name="ckptio-bench-rss", daemon=True)
            self._thread.start()
        except ImportError:
            self.method = "none"
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.method == "vmhwm":
            self.peak_increase = max(0, _vm_hwm_bytes() - self._base)
        elif self.method == "psutil-sampling":
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            import psutil

            self._peak = max(self._peak, psutil.Process().memory_info().rss)
            self.peak_increase = max(0, self._peak - self._base)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _thp_policy(name: str) -> str | None:
    """The bracketed choice in /sys/kernel/mm/transparent_hugepage/NAME (None where unreadable)."""
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip() or None


def _gil_switch_s() -> float | str | None:
    from ckptio.engine import gilswitch

    try:
        return gilswitch.interval_for(None)
    except ValueError as e:
        return f"invalid: {e}"


def environment(target_dir: str | None) -> dict[str, Any]:
    """Versions, machine and disk facts recorded with every run."""
    info: dict[str, Any] = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": {
            d: _version(d)
            for d in ("ckptio", "numpy", "torch", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "psutil")
        },
    }
    # What ckptio's own environment variables set (the writer, the switch interval, ...), and the
    # switch interval a save runs under with them (ckptio.engine.gilswitch): both move the --train figures.
    info["ckptio_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("CKPTIO_")}
    info["gil_switch_s"] = _gil_switch_s()
    # The writer process's shared-memory slabs get huge pages only where the shmem policy allows
    # (ckptio.saving.writers.shm): its O_DIRECT requests, and so a JAX save's speed, depend on it.
    info["transparent_hugepage"] = {k: _thp_policy(k) for k in ("enabled", "shmem_enabled")}
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
        if target_dir:
            st = os.statvfs(target_dir)
            info["target_free_bytes"] = st.f_bavail * st.f_frsize
            for part in sorted(psutil.disk_partitions(all=True), key=lambda p: -len(p.mountpoint)):
                if os.path.realpath(target_dir).startswith(part.mountpoint):
                    info["target_mount"] = {"device": part.device, "fstype": part.fstype, "mount": part.mountpoint}
                    break
    except ImportError:
        pass
    return info
