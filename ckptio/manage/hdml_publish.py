"""The end of a Hyperdisk ML volume's writer phase: verify a checkpoint, sync, mark it published.

It lives above the backends because it verifies (:mod:`ckptio.manage.verify`, and through it the
manifest and the store); the backend (:mod:`ckptio.backends.hyperdisk_ml`) owns only the
marker's name and :func:`is_published`, which need nothing but the backend itself.
"""

from __future__ import annotations

from ckptio.backends.hyperdisk_ml import PUBLISHED_NAME, HyperdiskMLBackend, is_published, published_key
from ckptio.manage.verify import verify_checkpoint

__all__ = ["PUBLISHED_NAME", "is_published", "publish"]


async def publish(backend: HyperdiskMLBackend, step_dir: str) -> None:
    """End of the writer phase for one checkpoint: verify every checksum, sync, mark published.

    Raises :class:`ckptio.IntegrityError` (and marks nothing) if any byte fails its checksum,
    so readers never attach to a volume whose checkpoint is damaged.
    """
    await verify_checkpoint(backend, step_dir)
    await backend.sync()
    try:
        await backend.create_if_absent(published_key(step_dir), b"")
    except FileExistsError:
        pass  # published before: publishing is idempotent
    await backend.sync()
