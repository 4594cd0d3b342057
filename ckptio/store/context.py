"""What every service of a store shares: the root, its backend (raw and retried), engine, naming, lease.

Services call storage through :attr:`StoreContext.io`, a
:class:`~ckptio.backends.retrying.RetryingBackend` around the backend with the
engine's retry policy: a call is retried there, once, and nowhere above it.
The engine keeps the raw backend (it retries its own writes and reads), so no
call is retried twice.
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptio.backends import Backend, open_backend
from ckptio.backends.base import ObjectInfo
from ckptio.backends.retrying import RetryingBackend
from ckptio.engine import Engine, gather_or_cancel
from ckptio.engine.layout import HashedNaming, Naming
from ckptio.manifest.names import ObjectName, is_hashed_component, parse_object
from ckptio.store.options import StoreOptions, default_naming

__all__ = ["StoreContext"]


class StoreContext:
    """The state of one store, built once from its :class:`StoreOptions` and shared by its services."""

    def __init__(self, options: StoreOptions) -> None:
        self.options = options
        self.url = options.url
        self.backend_options = dict(options.backend_options or {})
        backend = options.backend if options.backend is not None else open_backend(self.url, **self.backend_options)
        #: How another process opens the same backend (ckptio.saving.writers.sidecar): only a backend this store
        #: opened from its URL can be; one handed in (a wrapper, a test double) cannot.
        self.reopenable = options.backend is None
        self.engine = options.engine if options.engine is not None else Engine(backend, options.engine_config)
        cfg = self.engine.config
        self._raw = backend
        #: The backend, each call retried with the engine's policy, under the engine's deadlines and
        #: request budget (one share per host): what the services call.
        self.io = RetryingBackend(cfg.drive(backend), cfg.retry_policy)
        self.naming: Naming = options.naming or default_naming(backend)
        self.lease_s = options.resolved_lease_s()
        self.host_local = options.host_local

    @property
    def backend(self) -> Backend:
        """The backend as opened (or handed in): what the engine, and whoever reopens it, use."""
        return self._raw

    @backend.setter
    def backend(self, backend: Backend) -> None:
        # A test swaps in a failing wrapper mid-run: every service retries through the new one.
        self._raw = backend
        self.io.inner = self.engine.config.drive(backend)

    @property
    def concurrency(self) -> int:
        """How many storage calls the store's services keep in flight (twice this for small ones)."""
        return self.engine.concurrency

    def where(self, step_dir: str) -> str:
        """A human-readable URL of a step directory, for error messages."""
        return f"{self.url}/{step_dir}" if step_dir else self.url

    def parse_object(self, key: str) -> ObjectName | None:
        """The step and save of a key this store's naming (or a built-in one) writes; None: not ckptio's."""
        return parse_object(key, self.naming)

    def writers_of(self, keys: Iterable[str]) -> set[str]:
        """The save ids whose objects (or fragments) ``keys`` name."""
        return {n.save_id for k in keys if (n := self.parse_object(k)) is not None}

    async def exists(self, key: str) -> bool:
        """True if ``key`` exists (a stat, retried)."""
        try:
            await self.io.stat(key)
            return True
        except FileNotFoundError:
            return False

    async def delete_keys(self, keys: Iterable[str]) -> None:
        """Delete ``keys``, a bounded number at a time; a key already gone is fine."""

        async def one(key: str) -> None:
            try:
                await self.io.delete(key)
            except FileNotFoundError:
                pass

        await gather_or_cancel((one(k) for k in keys), limit=self.concurrency * 2)

    async def step_listing(self, step_dir: str, *, everywhere: bool) -> list[ObjectInfo]:
        """Everything under ``step_dir``; with ``everywhere``, under each object prefix's ``<p>/<step>/`` too.

        The prefixes are the root's hashed components and those the naming declares
        (:meth:`~ckptio.engine.layout.Naming.prefixes`) that exist.
        """
        if not step_dir:
            return []  # a root checkpoint shares its directory with everything else: delete by manifest only
        own = await self.io.list(step_dir + "/")
        if not everywhere:
            return own
        # A hashed naming's prefixes are the hashed components already matched (and may be millions).
        declared = set() if isinstance(self.naming, HashedNaming) else set(self.naming.prefixes())
        prefixes = [c for c in await self.io.list_children("") if is_hashed_component(c) or c in declared]
        out = list(own)

        async def one(p: str) -> None:
            out.extend(await self.io.list(f"{p}/{step_dir}/"))

        await gather_or_cancel((one(p) for p in prefixes), limit=self.concurrency * 2)
        return out
