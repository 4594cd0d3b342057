"""``progress=True`` on the native API: a tqdm bar of the bytes moved (stderr)."""

from __future__ import annotations

from collections.abc import Callable

from ckptio.engine.core import Progress

__all__ = ["progress_callback"]


def progress_callback(progress: Progress | bool | None, desc: str) -> tuple[Progress | None, Callable[[], None]]:
    """``(callback, close)`` for a ``progress`` argument: True makes a tqdm bar, a callable is used as is."""
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)
        return (lambda _key, n: bar.update(n)), bar.close
    if progress is False or progress is None:
        return None, lambda: None
    return progress, lambda: None
