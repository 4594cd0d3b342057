"""``check_resume``: does a training loop resume bit-exact from a ckptio checkpoint?

Put it in your own test suite: give it how to build the initial state and
data iterator, and one training step. It runs ``steps`` steps uninterrupted,
then runs again, saves at ``save_at`` (the state and the data iterator, in
one checkpoint), restores into freshly built objects -- in a new process by
default, as after a crash -- goes on to ``steps``, and reports the first step
where the batch, the loss or the state differ from the uninterrupted run
(bit for bit by default; a tolerance only if asked)::

    from ckptio.testing import check_resume

    def build():                      # module level: a new process imports it
        return init_state(), make_loader()

    def train_step(state, batch):
        ...
        return new_state, loss

    report = check_resume(build, train_step, steps=20, save_at=7)
    assert report.ok, report

``build()`` returns ``(state, data)``: ``state`` a pytree ckptio saves, and
``data`` a stateful data loader or iterator (torchdata's ``StatefulDataLoader``,
a grain iterator: see :mod:`ckptio.state.perhost`); batches come from ``iter(data)``.
``train_step(state, batch)`` returns ``(state, loss)``. Each step's batch, loss
and state are recorded with ckptio itself (no pickle), then compared as numpy.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np

from ckptio.api import restore, save
from ckptio.restoring.from_state import restore_target
from ckptio.state.tree import flatten_named

__all__ = ["ResumeReport", "check_resume"]

Build = Callable[[], tuple[Any, Any]]
Step = Callable[[Any, Any], tuple[Any, Any]]


@dataclasses.dataclass
class ResumeReport:
    """What :func:`check_resume` found. ``ok``: every step matched; else ``step`` is the first step
    (1-based) that differs, ``what`` the first thing that does (``"batch/0"``, ``"loss"``,
    ``"state/params/w"``) and ``detail`` how."""

    ok: bool
    steps: int
    save_at: int
    step: int | None = None
    what: str | None = None
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"resume from step {self.save_at} matches the uninterrupted run at all {self.steps} steps"
        return (f"resume from step {self.save_at} differs from the uninterrupted run at step {self.step}: "
                f"{self.what}: {self.detail}")


def _run(state: Any, it: Any, step_fn: Step, first: int, last: int, records: str) -> Any:
    """Steps ``first``..``last`` (1-based), each one's batch, loss and state saved under ``records``."""
    for i in range(first, last + 1):
        batch = next(it)
        state, loss = step_fn(state, batch)
        save(records, {"batch": batch, "loss": loss, "state": state}, step=i).result()
    return state


def _resume_part(build: Build, step_fn: Step, ckpt: str, save_at: int, steps: int, records: str) -> None:
    """The part after the restart: fresh objects, restored in place, on to ``steps``."""
    state, data = build()
    got = restore(ckpt, step=save_at, target={"state": restore_target(state), "data": data})
    _run(got["state"], iter(got["data"]), step_fn, save_at + 1, steps, records)


def check_resume(build: Build, step: Step, *, steps: int, save_at: int, new_process: bool = True,
                 rtol: float = 0.0, atol: float = 0.0, workdir: str | os.PathLike[str] | None = None) -> ResumeReport:
    """Run ``steps`` steps uninterrupted, then again with a save at ``save_at`` and a restore into
    fresh objects (in a new ``spawn`` process unless ``new_process=False``: ``build`` and ``step``
    must then be importable, module-level functions); compare every step. Tolerances
    (``rtol``, ``atol``, as numpy's ``allclose``) only if given: by default bit for bit.
    ``workdir``: where the checkpoint and the records go (default: a temporary directory)."""
    if not 0 < save_at < steps:
        raise ValueError(f"save_at must lie between 0 and steps ({steps}), got {save_at}")
    with tempfile.TemporaryDirectory() as tmp:
        base = os.fspath(workdir) if workdir is not None else tmp
        ref, resumed, ckpt = (os.path.join(base, d) for d in ("uninterrupted", "resumed", "checkpoint"))
        state, data = build()
        _run(state, iter(data), step, 1, steps, ref)
        state, data = build()
        state = _run(state, iter(data), step, 1, save_at, resumed)
        save(ckpt, {"state": state, "data": data}, step=save_at).result()
        del state, data  # the restart: nothing of the first run is used after it
        if new_process:
            proc = multiprocessing.get_context("spawn").Process(
                target=_resume_part, args=(build, step, ckpt, save_at, steps, resumed), name="ckptio-check-resume")
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise RuntimeError(f"check_resume: the resumed run's process exited {proc.exitcode}")
        else:
            _resume_part(build, step, ckpt, save_at, steps, resumed)
        return _compare(ref, resumed, steps, save_at, rtol, atol)


def _compare(ref: str, resumed: str, steps: int, save_at: int, rtol: float, atol: float) -> ResumeReport:
    for i in range(1, steps + 1):
        a, b = restore(ref, step=i), restore(resumed, step=i)
        for part in ("batch", "loss", "state"):
            problem = _differs(part, a[part], b[part], rtol, atol)
            if problem is not None:
                return ResumeReport(False, steps, save_at, i, *problem)
    return ResumeReport(True, steps, save_at)


def _differs(part: str, a: Any, b: Any, rtol: float, atol: float) -> tuple[str, str] | None:
    """``(what, how)`` of the first leaf where ``a`` and ``b`` differ; None if none does."""
    names_a, leaves_a, _ = flatten_named(a)
    names_b, leaves_b, _ = flatten_named(b)
    if names_a != names_b:
        return part, f"the trees differ: {sorted(set(names_a) ^ set(names_b))[:5]}"
    for name, x, y in zip(names_a, leaves_a, leaves_b):
        what = f"{part}/{name}" if name else part
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            return what, f"{x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}"
        if rtol == 0 and atol == 0:
            same = x.tobytes() == y.tobytes()
        else:
            same = bool(np.allclose(x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True))
        if not same:
            return what, f"{_head(x)} != {_head(y)}"
    return None


def _head(x: np.ndarray) -> str:
    return np.array2string(x.reshape(-1)[:6], precision=17) + ("..." if x.size > 6 else "")
