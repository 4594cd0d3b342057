"""Snapshots of accelerator arrays taken on their own device: the stall is a device copy, and the
bytes cross to the host behind it.

A training step that donates its inputs (``jax.jit(..., donate_argnums=...)``) may overwrite them
as soon as ``save`` returns, so a save must own a snapshot of every array before it returns. The
host has always been the snapshot's place: a device-to-host copy of the whole state inside the
step's stall (seconds for gigabytes; on one TPU v5e, 2.6 s for 6 GiB). A copy on the device itself
takes milliseconds (20 ms for those 6 GiB), and the device-to-host copy then runs in the
background, shard by shard, each device copy freed once its bytes are on the host.

Per shard (one per device, replica 0), by :class:`~ckptio.saving.options.SaveOptions`'s
``device_snapshot``:

- ``"auto"`` (default): on an accelerator, a device copy while the device's free memory allows
  (:class:`Headroom`); the shards that do not fit cross to the host in the stall, as before. On CPU
  devices a host view, no copy at all: jax never donates a buffer that a host view still holds.
- ``"device"``: a device copy wherever memory allows, CPU devices included (how CI runs this path).
- ``"host"``: every shard crosses to the host in the stall.
- ``"none"``: the caller promises the arrays are neither donated nor deleted until the save is
  written (``copy=False`` promises it too): no copy; their bytes cross in the background.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np

from ckptio.saving.staging import StagingArea

__all__ = ["POLICIES", "DeviceStaging", "Headroom", "Snapshots", "owns"]

log = logging.getLogger("ckptio.save")

POLICIES = ("auto", "device", "host", "none")
#: Device memory a snapshot never takes: this fraction of the device's limit, at least :data:`MARGIN_MIN`.
MARGIN = 0.05
MARGIN_MIN = 256 << 20


class Headroom:
    """The device memory this process's snapshots may take, per device.

    Free memory is what ``memory_stats()`` reports as the limit less the bytes in use, less the
    step's own working memory (what it allocates beyond the state while it runs: the peak over the
    bytes in use, as the first save measures it, before any snapshot raised the peak), less a
    margin. A device that reports no stats gets no snapshot on an accelerator (nothing proves it
    has room), and unbounded room on the host's own CPU devices.
    """

    #: Per device id: the step's working memory, as measured at this process's first save.
    working: dict[int, int] = {}

    def __init__(self) -> None:
        self._left: dict[int, int | None] = {}

    def take(self, device: Any, nbytes: int) -> bool:
        """Reserve ``nbytes`` of ``device`` for a snapshot; False if they do not fit."""
        if device.id not in self._left:
            self._left[device.id] = self._free(device)
        left = self._left[device.id]
        if left is not None and nbytes > left:
            return False
        if left is not None:
            self._left[device.id] = left - nbytes
        return True

    @classmethod
    def _free(cls, device: Any) -> int | None:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 -- a backend without stats: treated as no stats
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None if device.platform == "cpu" else 0
        limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        working = cls.working.setdefault(device.id, max(0, int(stats.get("peak_bytes_in_use", used)) - used))
        return max(0, limit - used - working - max(MARGIN_MIN, int(limit * MARGIN)))


class Snapshots:
    """Takes the snapshots of one save's jax shards by its policy (see the module)."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"SaveOptions.device_snapshot={policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.headroom = Headroom()
        self.pending: list[Any] = []
        self.copied = self.crossed = 0  # bytes copied on devices, and bytes that crossed in the stall

    def take(self, shard: Any) -> Any:
        """``shard`` (a single-device jax array) as a host array now, or as a device array whose
        bytes cross to the host later: a snapshot of this save's own, or (``"none"``) itself."""
        device = next(iter(shard.devices()))
        if self.policy == "none" or owns(shard):
            if shard.is_deleted():  # refused now, on the caller's thread; one deleted later is a broken promise
                raise RuntimeError(f"a jax array of {shard.dtype}{list(shard.shape)} was deleted (or donated) "
                                   "before its save: device_snapshot='none' needs it kept until the save is written")
            return shard
        if self.policy == "host" or (self.policy == "auto" and device.platform == "cpu"):
            return self._cross(shard)
        if not self.headroom.take(device, shard.nbytes):
            return self._cross(shard)
        try:
            snap = _device_copy(shard)
        except Exception as e:  # noqa: BLE001 -- a device out of memory: the host, as before
            log.warning("a device copy of %d bytes failed (%r); the rest of this save crosses to the host",
                        shard.nbytes, e)
            self.headroom.take(device, 1 << 62)  # nothing more on this device
            return self._cross(shard)
        _OWNED[id(snap)] = weakref.ref(snap, lambda _r, i=id(snap): _OWNED.pop(i, None))
        self.pending.append(snap)
        self.copied += shard.nbytes
        return snap

    def _cross(self, shard: Any) -> np.ndarray:
        self.crossed += shard.nbytes
        return np.asarray(shard)  # JAX arrays are immutable: a host copy (a view on CPU) is a snapshot

    def settle(self) -> None:
        """The device copies were dispatched; nothing is waited for. They run on their devices before any
        step dispatched after the save (a device runs its work in order, and a donation waits for every
        use of the buffer), and a device out of memory refuses the copy when it is dispatched (caught
        in :meth:`take`), so the step never waits for them in the stall."""
        self.pending = []


class DeviceStaging(Snapshots):
    """:class:`Snapshots` staged into a save's area: a device array's bytes fill a host buffer later."""

    def __init__(self, policy: str, area: StagingArea) -> None:
        super().__init__(policy)
        self.area = area

    def stage(self, shard: Any) -> np.ndarray:
        """A host array of ``shard`` now, or a buffer the save's background fill copies it into."""
        got = self.take(shard)
        return got if isinstance(got, np.ndarray) else self.area.from_device(got, owned=owns(got))


#: The device snapshots ckptio made and still holds (by id): deleted once their bytes are on the host.
_OWNED: dict[int, weakref.ref[Any]] = {}


def owns(arr: Any) -> bool:
    """True if ``arr`` is a snapshot ckptio made (never a caller's array)."""
    ref = _OWNED.get(id(arr))
    return ref is not None and ref() is arr


def _device_copy(shard: Any) -> Any:
    """A copy of ``shard`` in new memory of its own device (never an alias: a donated input stays ours)."""
    import jax.numpy as jnp

    return jnp.copy(shard)
