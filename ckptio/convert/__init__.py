"""Convert checkpoints between ckptio and Orbax / PyTorch DCP directories, streaming.

>>> from ckptio.convert import convert
>>> convert("/ckpt/dcp_run/step_100", "gs://bucket/run1", src_format="dcp", dst_format="ckptio", step=100)
>>> convert("gs://bucket/run1", "/tmp/export", src_format="ckptio", dst_format="orbax", step=100)

or on the command line: ``ckptio convert SRC DST --from dcp --to ckptio [--step N]``.

=========================  ===================================================
direction                  how (see the modules)
=========================  ===================================================
DCP dir -> ckptio          :func:`ckptio.convert.dcp.dcp_to_ckptio`
ckptio -> DCP dir          :func:`ckptio.convert.dcp.ckptio_to_dcp`
Orbax PyTree dir -> ckptio :func:`ckptio.convert.orbax.orbax_to_ckptio`
ckptio -> Orbax PyTree dir :func:`ckptio.convert.orbax.ckptio_to_orbax`
=========================  ===================================================

Every direction streams: a bounded number of blocks (about ``block_bytes``
each) is in memory at a time, never the whole state. DCP and Orbax
directories are local paths; the ckptio side is any ckptio URL. ``step`` is
the ckptio side's step: the one to read (default: the newest committed)
or the one to write (default: the URL itself is the checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import os

from ckptio.engine import EngineConfig, Progress, run_sync
from ckptio.manifest import ArrayItem, Manifest
from ckptio.store import CheckpointStore

__all__ = ["FORMATS", "ConvertResult", "convert", "source_bytes"]

FORMATS = ("ckptio", "dcp", "orbax")


@dataclasses.dataclass
class ConvertResult:
    """What a conversion wrote (JSON-able with :func:`dataclasses.asdict`)."""

    src: str
    dst: str
    src_format: str
    dst_format: str
    step: int | None
    items: int
    bytes: int


def _array_bytes(m: Manifest) -> int:
    return sum(i.nbytes for i in m.items.values() if isinstance(i, ArrayItem))


def source_bytes(src: str, src_format: str, step: int | None = None) -> int | None:
    """The array bytes a conversion of ``src`` will move (for progress bars); None if unknown."""
    try:
        if src_format == "ckptio":
            store = CheckpointStore(src)
            try:
                return _array_bytes(run_sync(store.read_manifest(run_sync(store.resolve(step)))))
            finally:
                run_sync(store.close())
        if src_format == "dcp":
            from torch.distributed.checkpoint import FileSystemReader

            return sum(
                getattr(i, "length", 0) for i in FileSystemReader(src).read_metadata().storage_data.values()
            )
        if src_format == "orbax":
            import orbax.checkpoint as ocp
            from etils import epath

            from ckptio.convert.orbax import find_pytree_dir

            tree = (
                ocp.PyTreeCheckpointHandler().metadata(epath.Path(os.path.abspath(find_pytree_dir(src)))).tree
            )
            import jax

            return sum(
                math.prod(x.shape) * x.dtype.itemsize
                for x in jax.tree.leaves(tree)
                if isinstance(x, ocp.metadata.ArrayMetadata) and x.shape
            )
    except Exception:  # only a progress bar's total
        return None
    return None


def convert(
    src: str,
    dst: str,
    *,
    src_format: str,
    dst_format: str,
    step: int | None = None,
    engine_config: EngineConfig | None = None,
    block_bytes: int = 64 << 20,
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert the checkpoint ``src`` (``src_format``) into ``dst`` (``dst_format``); one side is ckptio."""
    if src_format not in FORMATS or dst_format not in FORMATS:
        raise ValueError(f"formats are {FORMATS}, got {src_format!r} -> {dst_format!r}")
    if (src_format == "ckptio") == (dst_format == "ckptio"):
        hint = (
            " (to copy a ckptio checkpoint use `ckptio cp`)"
            if src_format == "ckptio"
            else " (convert to ckptio first, then from it)"
        )
        raise ValueError(f"one side of a conversion must be ckptio, got {src_format} -> {dst_format}{hint}")
    if dst_format == "ckptio":
        store = CheckpointStore(dst, engine_config=engine_config)
        try:
            if src_format == "dcp":
                from ckptio.convert.dcp import dcp_to_ckptio

                m = dcp_to_ckptio(src, store, step, batch_bytes=block_bytes, progress=progress)
            else:
                from ckptio.convert.orbax import orbax_to_ckptio

                m = orbax_to_ckptio(src, store, step, block_bytes=block_bytes, progress=progress)
        finally:
            run_sync(store.close())
        return ConvertResult(src, dst, src_format, dst_format, m.step, len(m.items), _array_bytes(m))
    store = CheckpointStore(src, engine_config=engine_config)
    try:
        step_dir = run_sync(store.resolve(step))
        m = run_sync(store.read_manifest(step_dir))
        if dst_format == "dcp":
            from ckptio.convert.dcp import ckptio_to_dcp

            ckptio_to_dcp(store, step_dir, dst, chunk_bytes=block_bytes, progress=progress)
        else:
            from ckptio.convert.orbax import ckptio_to_orbax

            ckptio_to_orbax(store, step_dir, dst, block_bytes=block_bytes, progress=progress)
    finally:
        run_sync(store.close())
    return ConvertResult(src, dst, src_format, dst_format, m.step, len(m.items), _array_bytes(m))
