"""DCP's stream transforms (``_extensions``, e.g. ``ZStandard``) applied the way ``FileSystemWriter`` does.

DCP's ``StreamTransformExtension`` wraps a byte stream (``transform_to`` on
write, ``transform_from`` on read), and its descriptors (``"stream.zstd/1"``)
are recorded per item, in the reverse of the order the writer applied them;
the reader rebuilds the extensions from the descriptors through an
``ExtensionRegistry``. ckptio uses torch's own classes and registry, so a
checkpoint written with ``Writer(_extensions=[ZStandard()])`` records what
``FileSystemWriter`` would, and a stock checkpoint's descriptors are undone
by the same code torch's ``FileSystemReader`` uses.

A transformed item is transformed whole (it cannot be read by byte range
any more): transforms trade ranged reads for size.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

__all__ = ["apply", "check_extensions", "undo"]


class _NoClose(io.RawIOBase):
    """A writable view of ``raw`` whose close only flushes: closing the transform chain must not close our buffer."""

    def __init__(self, raw: io.BytesIO) -> None:
        super().__init__()
        self.raw = raw

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.raw.write(b)

    def close(self) -> None:
        self.raw.flush()
        super().close()


def check_extensions(extensions: Sequence[Any] | None) -> tuple[Any, ...]:
    """The writer's extensions, each a DCP ``StreamTransformExtension`` (TypeError naming any other)."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    out = tuple(extensions or ())
    for ex in out:
        if not isinstance(ex, StreamTransformExtension):
            raise TypeError(
                f"ckptio.dcp.Writer: extension {ex!r} is not a torch.distributed.checkpoint StreamTransformExtension "
                "(only stream transforms such as ZStandard change how bytes are stored)"
            )
    return out


def apply(extensions: Sequence[Any], data: memoryview) -> tuple[memoryview, tuple[str, ...]]:
    """``data`` through each extension's ``transform_to`` (in order), and the descriptors DCP records."""
    if not extensions:
        return data, ()
    out = io.BytesIO()
    stream: Any = _NoClose(out)
    for ex in extensions:
        stream = ex.transform_to(stream)
    stream.write(data)
    stream.close()  # flushes the compressor's frame into ``out``
    return out.getbuffer(), tuple(ex.get_descriptor() for ex in reversed(extensions))


def undo(descriptors: Sequence[str], data: Any, registry: Any | None, where: str) -> bytes:
    """The original bytes of ``data`` stored with ``descriptors``, through DCP's ``ExtensionRegistry``.

    ValueError naming ``where`` if an extension is unknown or unavailable
    (e.g. ZStandard without the ``zstandard`` or ``pyzstd`` module).
    """
    if not descriptors:
        return bytes(data)
    from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

    reg = registry if registry is not None else ExtensionRegistry()
    try:
        extensions = reg.from_descriptor_list(list(descriptors))
    except ValueError as e:
        raise ValueError(f"{where}: cannot undo the stored transforms {list(descriptors)}: {e}") from e
    stream: Any = io.BytesIO(data)
    for ex in extensions:
        if isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    return stream.read(-1)
