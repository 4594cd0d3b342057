"""ckptio itself, through its public native API, on numpy, jax and torch state.

Written against the public surface only (``ckptio.CheckpointManager``: ``save(step,
state) -> handle``, ``handle.result()``, ``restore(step)``), so the bench
measures what users get. One manager per worker process, reused across
rounds: that is how a training job uses it, and it lets the engine reuse its
staging buffers from one save to the next.

Multi-process (``--sweep`` procs): every rank calls the same API inside an
initialised ``torch.distributed`` gloo group (the engine coordinates through
it) with the whole tree, each array a ``ckptio.Sharded`` holding the
arrays this rank owns in full and no piece of the others: the same bytes
per rank as the raw disk and DCP cases write. Restore asks each rank for
its own arrays only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ckptio.bench.cases import Case, Pending, register
from ckptio.bench.state import describe

__all__ = ["CkptioJax", "CkptioNumpy", "CkptioTorch"]


class _Handle:
    """Wraps a ckptio save handle to keep the engine's own timings, when it reports any."""

    def __init__(self, handle: Any, sink: list[Any]) -> None:
        self._handle = handle
        self._sink = sink

    def result(self) -> Any:
        out = self._handle.result()
        timings = getattr(self._handle, "timings", None)
        if timings is not None:
            self._sink.append(dict(timings) if isinstance(timings, Mapping) else timings)
        return out


@register
class CkptioNumpy(Case):
    """``ckptio.CheckpointManager`` on numpy arrays."""

    name = "ckptio"
    kind = "ckptio"
    framework = "numpy"
    requires: ClassVar[tuple[str, ...]] = ("ckptio",)
    schemes = frozenset({"*"})  # any URL ckptio has a backend for
    max_world = 64
    sweep_max_tensors = 1_000_000
    description = "ckptio.CheckpointManager.save/restore (numpy state)"
    durability = "ckptio: objects durable, then manifest committed (handle.result())"

    def setup(self) -> None:
        import ckptio

        # Keep every round's step: retention deletes must not land inside a timed save.
        keep = int(self.ctx.options.get("rounds", 3)) + 1
        self._mngr = ckptio.CheckpointManager(self.ctx.root, max_to_keep=keep)
        self._timings: list[Any] = []

    def _payload(self) -> dict[str, Any]:
        if self.ctx.world_size == 1:
            return dict(self.state)
        from ckptio import Sharded

        out: dict[str, Any] = {}
        for name, (shape, dtype) in describe(self.ctx.spec).items():
            mine = self.state.get(name)
            index = (slice(None),) * len(shape)
            out[name] = Sharded(shape, dtype, [(index, mine)] if mine is not None else [])
        return out

    def save(self, step: int) -> Pending | None:
        return _Handle(self._mngr.save(step, self._payload()), self._timings)

    def restore(self, step: int) -> Mapping[str, Any]:
        if self.ctx.world_size == 1:
            # As a restarted job restores: a store of its own, so the manifest is read and checked
            # too (the manager caches the manifests it committed; a fresh process has none).
            import ckptio

            return ckptio.restore(self.ctx.root, step)
        from ckptio import Sharded

        target = {k: Sharded(v.shape, v.dtype, [((slice(None),) * v.ndim, None)]) for k, v in self.state.items()}
        out = self._mngr.restore(step, target=target)
        return {k: out[k].pieces[0][1] for k in self.state}

    def step_path(self, step: int) -> str | None:
        # The layout (flat or hashed names) is the engine's business: drop caches and
        # measure sizes over the whole case root, which holds only this case's steps.
        return self.ctx.root if self.ctx.scheme == "file" else None

    def info(self) -> dict[str, Any]:
        return {"engine_timings": self._timings} if self._timings else {}

    def close(self) -> None:
        wait = getattr(self._mngr, "wait_until_finished", None)
        if wait is not None:
            wait()
        close = getattr(self._mngr, "close", None)
        if close is not None:
            close()


@register
class CkptioJax(CkptioNumpy):
    """The same on jax CPU arrays: compare its stall with Orbax's (immutable arrays need no copy)."""

    name = "ckptio-jax"
    framework = "jax"
    requires = ("ckptio", "jax")
    max_world = 1
    sweep_max_tensors = 0
    description = "ckptio.CheckpointManager.save/restore (jax CPU arrays)"


@register
class CkptioTorch(CkptioNumpy):
    """The same on torch tensors: its stall should be at most one memcpy of the state."""

    name = "ckptio-torch"
    framework = "torch"
    requires = ("ckptio", "torch")
    max_world = 1
    sweep_max_tensors = 0
    description = "ckptio.CheckpointManager.save/restore (torch tensors)"


def _dcp_cases() -> type[Case]:
    """ckptio under DCP: the same DCP calls as the ``dcp`` anchors, with ckptio's Writer/Reader."""
    from ckptio.bench.anchors_torch import DCPAsyncProcessSave, DCPAsyncSave, DCPSave

    class _CkptioDCP:
        requires = ("ckptio", "torch")

        def _writer(self: Any, step: int) -> Any:
            from ckptio.dcp import Writer

            return Writer(self.step_path(step) or "")

        def restore(self: Any, step: int) -> Mapping[str, Any]:
            import torch

            from ckptio.dcp import Reader

            target = {k: torch.empty_like(v) for k, v in self.state.items()}
            self._dcp.load(target, storage_reader=Reader(self.step_path(step) or ""))
            return target

    @register
    class CkptioDCP(_CkptioDCP, DCPSave):  # type: ignore[misc]
        name = "ckptio-dcp"
        kind = "ckptio"
        max_world = 1
        sweep_max_tensors = 0
        description = "dcp.save(storage_writer=ckptio.dcp.Writer); dcp.load(storage_reader=ckptio.dcp.Reader)"

    @register
    class CkptioDCPAsync(_CkptioDCP, DCPAsyncSave):  # type: ignore[misc]
        name = "ckptio-dcp-async"
        kind = "ckptio"
        max_world = 1
        sweep_max_tensors = 0
        description = "dcp.async_save(storage_writer=ckptio.dcp.Writer) (its pooled stager); Reader"

    @register
    class CkptioDCPAsyncProcess(CkptioDCPAsync, DCPAsyncProcessSave):  # type: ignore[misc]
        name = "ckptio-dcp-async-process"
        in_default_run = False
        description = "dcp.async_save(storage_writer=ckptio.dcp.Writer), process executor; Reader"

    return CkptioDCPAsync


_dcp_async = _dcp_cases()


def _orbax_cases() -> type[Case]:
    """ckptio under Orbax: the same ``ocp.CheckpointManager`` as the anchors, with ckptio's handler."""
    from ckptio.bench.anchors_jax import _OrbaxBase

    @register
    class CkptioOrbax(_OrbaxBase):
        name = "ckptio-orbax"
        kind = "ckptio"
        requires = ("ckptio", "jax", "orbax.checkpoint")
        max_world = 1
        sweep_max_tensors = 0
        description = "ocp.CheckpointManager + ckptio.orbax.Save/Restore, async"

        def _manager(self, ocp: Any, options: Any) -> Any:
            import ckptio.orbax  # noqa: F401  (registers Save/Restore with the handler)

            return ocp.CheckpointManager(self.ctx.root, options=options)

        def _save_args(self, ocp: Any) -> Any:
            import ckptio.orbax

            return ckptio.orbax.Save(self.state)

        def _restore_args(self, ocp: Any, abstract: Mapping[str, Any]) -> Any:
            import ckptio.orbax

            return ckptio.orbax.Restore(abstract)

        def info(self) -> dict[str, Any]:
            return {"compressor": None}

    return CkptioOrbax


_orbax = _orbax_cases()


def _writer_cases() -> None:
    """Each ckptio case again with its object writes in a writer process (``CKPTIO_WRITER=sidecar``),
    and the native and Orbax cases again in-process (``CKPTIO_WRITER=thread``): a large save on a
    local disk goes to the writer process by default (``ckptio.saving.writers.auto``), so ``ckptio``,
    ``ckptio-jax``, ``ckptio-torch`` and ``ckptio-orbax`` are that default (``ckptio-dcp*`` are not).

    Not in the default run: ``--cases 'ckptio*'`` puts each case beside its twins, so one
    ``--train`` run shows what the writer process buys the training thread. The variable is set in
    the case's own worker process, so it reaches every front-end (native, DCP, Orbax) alike.
    """
    import os

    twins = [(base, "sidecar") for base in (CkptioNumpy, CkptioJax, CkptioTorch, _dcp_async, _orbax)]
    in_process = [(base, "thread") for base in (CkptioNumpy, CkptioJax, CkptioTorch, _orbax)]
    for base, writer in [*twins, *in_process]:

        def setup(self: Any, _base: type[Case] = base, _writer: str = writer) -> None:
            os.environ["CKPTIO_WRITER"] = _writer
            _base.setup(self)

        where = "a sidecar process" if writer == "sidecar" else "this process (the default's opt-out)"
        register(type(f"{base.__name__}{writer.title()}", (base,), {
            "name": f"{base.name}-{writer}",
            "in_default_run": False,
            "description": f"{base.description}; object writes in {where}",
            "setup": setup,
            "__doc__": f"{base.name} with CKPTIO_WRITER={writer}.",
        }))


_writer_cases()
