"""Where ``Lease``, ``async_lease`` and ``new_id`` were imported from: they live in :mod:`ckptio.store.intents`."""

from __future__ import annotations

from .store.intents import Lease, async_lease, new_id

__all__ = ["Lease", "async_lease", "new_id"]
