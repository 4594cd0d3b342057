"""What a save is told beyond its state and where it goes: :class:`SaveOptions`.

Every entry point that saves takes one as ``save_options`` (``ckptio.save``, ``CheckpointManager``,
``TieredCheckpointManager``, ``ckptio.dcp.Writer``, the Orbax handler), and each knob is read here, by
the save, once: the engine never sees them (its knobs are :class:`~ckptio.engine.EngineConfig`'s).
"""

from __future__ import annotations

import dataclasses

from ckptio.engine import gilswitch
from ckptio.engine.layout import LayoutOptions
from ckptio.saving.devicecopy import POLICIES
from ckptio.saving.writers.base import WRITERS, Writer, writer_asked, writer_name
from ckptio.saving.writers.sidecar import writer_for
from ckptio.store import CheckpointStore

__all__ = ["SaveOptions"]


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    """How saves run (picklable); ``None`` fields take the environment's setting, else the default."""

    #: Who writes a save's objects: "thread" (this process's IO loop), "sidecar" (a writer process per
    #: host fed from shared-memory staging, so that nothing of a background save runs under the
    #: training process's GIL), or a :class:`~ckptio.saving.writers.base.Writer` object. None: the
    #: ``CKPTIO_WRITER`` environment variable, else "thread" -- except a save of 64 MiB or more of
    #: arrays to a local disk, which then goes to the writer process (``ckptio.saving.writers.auto``).
    writer: str | Writer | None = None
    #: Shards of 2+ dimensions larger than two tiles are stored as tiles of about this many bytes
    #: (``ckptio.engine.tiling``), so that a restore onto another sharding reads only the tiles it
    #: meets; 0 keeps every shard in C order; None: the backend's ``layout_defaults.tile_bytes``.
    tile_bytes: int | None = None
    #: The interpreter's switch interval (seconds) while a save's background work runs in this
    #: process (``ckptio.engine.gilswitch``): its commit is ~110 short steps that each wait for the GIL
    #: a training step gives up only every interval. None: ``CKPTIO_GIL_SWITCH_S``, else 0.5 ms;
    #: 0: leave the process's interval alone.
    gil_switch_s: float | None = None
    #: Where a jax array's snapshot is taken (``ckptio.saving.devicecopy``): "auto" (a copy on its own
    #: accelerator while free memory allows, its bytes moved to the host in the background; CPU arrays
    #: need none), "device" (on every device, CPU included), "host" (every byte crosses to the host
    #: inside the stall) or "none" (never donated nor deleted until the save is written: no copy).
    device_snapshot: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.writer, str) and self.writer not in WRITERS:
            raise ValueError(f"SaveOptions.writer={self.writer!r}: the writer must be one of {', '.join(WRITERS)}")
        if self.tile_bytes is not None and (not isinstance(self.tile_bytes, int) or self.tile_bytes < 0):
            raise ValueError(f"SaveOptions.tile_bytes={self.tile_bytes!r}: a number of bytes >= 0, or None")
        self.gil_interval()  # a bad interval is refused here, not inside a save
        if self.device_snapshot not in POLICIES:
            raise ValueError(f"SaveOptions.device_snapshot={self.device_snapshot!r}: one of {', '.join(POLICIES)}")

    @property
    def layout(self) -> LayoutOptions:
        """The layout choices these options make."""
        return LayoutOptions(tile_bytes=self.tile_bytes)

    @property
    def writer_object(self) -> Writer | None:
        """The :class:`~ckptio.saving.writers.base.Writer` object given as ``writer``, if one was."""
        return None if self.writer is None or isinstance(self.writer, str) else self.writer

    @property
    def writer_asked(self) -> bool:
        """Whether a writer was named (here or by ``CKPTIO_WRITER``): then no default rule overrides it."""
        return self.writer_object is not None or writer_asked(self.writer)  # type: ignore[arg-type]

    def writer_name(self) -> str:
        """The writer asked for: "thread" or "sidecar" (ValueError naming ``CKPTIO_WRITER``'s bad value)."""
        w = self.writer_object
        return w.name if w is not None else writer_name(self.writer)  # type: ignore[arg-type]

    def writer_for(self, store: CheckpointStore) -> Writer:
        """The writer of a save to ``store``: the object given, else the one named (the writer process
        only where ``store`` allows one: :func:`ckptio.saving.writers.base.wanted_sidecar`)."""
        return self.writer_object or writer_for(store, self.writer)  # type: ignore[arg-type]

    def gil_interval(self) -> float | None:
        """The switch interval while a save's background work runs, in seconds; None: leave it."""
        return gilswitch.interval_for(self.gil_switch_s, "SaveOptions.gil_switch_s")
