"""The case interface and its registry.

A *case* is one way of saving and restoring the state: ckptio itself, or an
anchor (the raw disk, Orbax, DCP, torch.save, tensorstore) it is measured
against. Adding one is a subclass and a decorator::

    @register
    class MyCase(Case):
        name = "my-case"
        kind = "anchor"                 # or "ckptio", or "floor"
        framework = "numpy"             # which state it gets: numpy / jax / torch
        requires = ("mylib",)           # importable modules, else it is skipped
        schemes = frozenset({"file"})   # storage URL schemes it can target

        def save(self, step):           # return None when durable on return,
            ...                         # else an object with .result()
        def restore(self, step):        # return the mapping of arrays, materialised
            ...

and the module is listed in :data:`CASE_MODULES` (or exposed through the
``ckptio.bench.cases`` entry-point group by a third party). Modules are
imported only when the registry is first used, and case modules import their
framework only inside methods: listing cases stays cheap.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol

from ckptio.bench.spec import StateSpec

__all__ = ["CASE_MODULES", "Case", "CaseContext", "Pending", "all_cases", "get_case", "register"]

# Built-in case modules, in the order their cases appear in tables.
CASE_MODULES: tuple[str, ...] = (
    "ckptio.bench.anchors_raw",
    "ckptio.bench.anchors_direct",
    "ckptio.bench.anchors_jax",
    "ckptio.bench.anchors_torch",
    "ckptio.bench.anchors_gcs",
    "ckptio.bench.cases_ckptio",
)
ENTRY_POINT_GROUP = "ckptio.bench.cases"

_REGISTRY: dict[str, type[Case]] = {}
_loaded = False


class Pending(Protocol):
    """What an asynchronous save returns: ``result()`` blocks until durable and committed."""

    def result(self) -> Any: ...


@dataclasses.dataclass
class CaseContext:
    """Where and what a case saves.

    ``root`` is the case's own fresh directory (a plain path for ``file``
    targets) or URL (``gs://…``); ``scheme`` is its URL scheme (``file`` for a
    path). In a multi-process job, ``rank``/``world_size`` say which share of
    the arrays this process owns (the state passed to the case is that share).
    """

    root: str
    scheme: str
    spec: StateSpec
    rank: int = 0
    world_size: int = 1
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


class Case(abc.ABC):
    """One save/restore implementation under test; one instance per worker process."""

    name: ClassVar[str]
    kind: ClassVar[str] = "anchor"  # "ckptio" | "anchor" | "floor" (a reference that has no restore)
    framework: ClassVar[str] = "numpy"  # state type the case receives: numpy | jax | torch
    requires: ClassVar[tuple[str, ...]] = ()
    schemes: ClassVar[frozenset[str]] = frozenset({"file"})
    max_world: ClassVar[int] = 1  # largest process count it supports (--sweep procs)
    sweep_max_tensors: ClassVar[int] = 0  # largest tensor count in --sweep counts; 0 = not swept
    has_restore: ClassVar[bool] = True
    in_default_run: ClassVar[bool] = True
    description: ClassVar[str] = ""
    durability: ClassVar[str] = ""  # who fsyncs what, so a reader can judge fairness

    def __init__(self, ctx: CaseContext, state: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self.state = state

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this case cannot run here (a missing module), or None."""
        for mod in cls.requires:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed"
        return None

    def setup(self) -> None:
        """Once per process, untimed: imports, managers, process groups."""

    @abc.abstractmethod
    def save(self, step: int) -> Pending | None:
        """Save ``self.state`` as ``step``. The time until it returns is the stall.

        Return None when the checkpoint is already durable, else a
        :class:`Pending` whose ``result()`` returns once it is.
        """

    def restore(self, step: int) -> Mapping[str, Any]:
        """Read ``step`` back into fresh memory; return name -> array, fully materialised."""
        raise NotImplementedError(f"{self.name} has no restore")

    def step_path(self, step: int) -> str | None:
        """The local directory holding ``step`` (for cache drops and sizes); None if not local."""
        return f"{self.ctx.root}/step_{step}" if self.ctx.scheme == "file" else None

    def info(self) -> dict[str, Any]:
        """Facts about how the case ran, recorded in the JSON (e.g. verified compression)."""
        return {}

    def close(self) -> None:
        """Release managers, thread pools and process groups."""


def register(cls: type[Case]) -> type[Case]:
    """Class decorator: add a case to the registry under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"bench case {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in CASE_MODULES:
        importlib.import_module(mod)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()  # importing the module registers its cases


def all_cases() -> list[type[Case]]:
    """Every registered case, built-ins in module order, then entry points."""
    _load()
    return list(_REGISTRY.values())


def get_case(name: str) -> type[Case]:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no bench case {name!r}; known: {', '.join(_REGISTRY)}") from None
