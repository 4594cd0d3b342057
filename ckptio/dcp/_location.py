"""Where a DCP checkpoint lives: a URL (any ckptio backend) and an optional step.

``Writer(url)`` makes ``url`` itself the checkpoint (its manifest is
``<url>/ckptio.manifest.json``). ``Writer(root, step=100)`` puts it in
``<root>/100`` exactly as ``ckptio.save(root, state, step=100)`` would: on
object stores the hashed object-name component then comes *before* the
step, so every save spreads over the same warmed-up key ranges, and
``CheckpointManager(root)`` / ``ckptio ls root`` see DCP saves as steps.

The backend and engine are created lazily, in the process that does the IO,
and dropped when pickled: DCP's process-based ``async_save`` pickles the
writer into its checkpoint process, so only this small config travels.
"""

from __future__ import annotations

import os
from typing import Any

from ckptio.backends import backend_class, split_url
from ckptio.engine import EngineConfig, run_sync
from ckptio.engine.layout import Naming
from ckptio.store import CheckpointStore, StoreOptions, step_dir_of

__all__ = ["Located"]


class Located:
    """The URL/step/options of one checkpoint and a lazily opened :class:`CheckpointStore`.

    The root URL, engine config, naming and backend options are one :class:`StoreOptions`.
    """

    step: int | None

    def _init_location(
        self,
        url: str | os.PathLike[str],
        step: int | None,
        engine_config: EngineConfig | None,
        backend_options: dict[str, Any] | None,
        naming: Naming | None = None,
    ) -> None:
        self.step = step
        self.step_dir = step_dir_of(step)  # validates the step
        self._options = StoreOptions(os.fspath(url), engine_config=engine_config, naming=naming,
                                     backend_options=dict(backend_options or {}))
        self._store: CheckpointStore | None = None

    @property
    def url(self) -> str:
        """The root URL (the checkpoint's own without a step)."""
        return self._options.url

    @property
    def engine_config(self) -> EngineConfig | None:
        """The engine's knobs the store opens with."""
        return self._options.engine_config

    @property
    def backend_options(self) -> dict[str, Any]:
        """The options the backend opens with."""
        return dict(self._options.backend_options or {})

    @property
    def naming(self) -> Naming | None:
        """The object naming the store opens with (None: the backend's)."""
        return self._options.naming

    @property
    def store_options(self) -> StoreOptions:
        """The options of this checkpoint's store (its root URL, not the step's)."""
        return self._options

    def _relocate(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: a given id is the checkpoint's URL (no step)."""
        if checkpoint_id:
            self._close()
            self._options = self._options.at(checkpoint_id)
            self.step, self.step_dir = None, ""

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's URL (DCP logs it; errors name it)."""
        return f"{self.url}/{self.step_dir}" if self.step_dir else self.url

    def _open(self) -> CheckpointStore:
        if self._store is None:
            self._store = CheckpointStore(self._options)
        return self._store

    def _close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            run_sync(store.close())

    def close(self) -> None:
        """Release the backend's connections and threads (reopened on next use)."""
        self._close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # never pickle connections, threads or buffers
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True if some ckptio backend serves this URL or path."""
        if not isinstance(checkpoint_id, (str, os.PathLike)):
            return False
        try:
            backend_class(split_url(os.fspath(checkpoint_id))[0])
        except ValueError:
            return False
        return True
