"""Deadlines on collective waits: a host that never arrives fails the others by name, not by hanging.

A save's commit, a restore's agreement on the step and its verdict, read-once's
exchange and the tiers' rounds all wait for every host. A host that dies or hangs
outside storage (storage calls have their own deadlines, ``ckptio.backends.deadline``)
would hold the others until the framework's own timeout (torch's process group:
30 min; ckptio's jax key-value waits: 1 h), and then fail without saying who.

The caller of a collective says what it waits for and for how long
(:func:`waiting_for`, a thread-local: a coordinator's method reads it with
:func:`current`); a coordinator that can bound its waits (``TorchCoordinator``
through the torch store, ``JaxCoordinator`` through the coordination service)
raises :class:`CollectiveTimeout` on every waiting host, naming the hosts that did
not arrive and the wait, e.g. ``commit of step 40: hosts 3, 7 did not report
within 120 s``. A wait nobody labelled gets :data:`UNLABELLED_S`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator

from ckptio.engine.core import UNLABELLED_S
from ckptio.errors import CkptioError

__all__ = ["CollectiveTimeout", "UNLABELLED_S", "Wait", "current", "missing_message", "waiting_for"]


@dataclasses.dataclass(frozen=True)
class Wait:
    """What a collective waits for (``what``, as an error names it) and for how long."""

    what: str
    deadline_s: float


class CollectiveTimeout(CkptioError, TimeoutError):
    """Hosts did not arrive at a collective in time: ``hosts`` (ranks; empty when unknown),
    ``what`` the wait was for, ``deadline_s``."""

    def __init__(self, message: str, *, hosts: tuple[int, ...] = (), what: str = "", deadline_s: float = 0.0) -> None:
        super().__init__(message)
        self.hosts, self.what, self.deadline_s = hosts, what, deadline_s


_local = threading.local()


@contextlib.contextmanager
def waiting_for(what: str, deadline_s: float) -> Iterator[Wait]:
    """Collectives this thread calls inside the block wait at most ``deadline_s`` each, and an
    expiry names ``what`` (e.g. ``"commit of step 40"``). Nested blocks: the innermost wins."""
    if not deadline_s > 0:
        raise ValueError(f"waiting_for({what!r}): the deadline must be > 0 seconds, got {deadline_s!r}")
    outer = getattr(_local, "wait", None)
    _local.wait = Wait(what, float(deadline_s))
    try:
        yield _local.wait
    finally:
        _local.wait = outer


def current() -> Wait:
    """The wait this thread's collectives are under (:func:`waiting_for`), or the unlabelled one."""
    wait = getattr(_local, "wait", None)
    return wait if wait is not None else Wait("a collective of ckptio", UNLABELLED_S)


def missing_message(wait: Wait, hosts: Iterable[int], verb: str = "report") -> str:
    """``"<what>: hosts 3, 7 did not <verb> within 120 s"`` (at most 16 hosts named, then a count:
    the message travels to every host, so it must not grow with the job)."""
    ranks = sorted(hosts)
    named = ", ".join(str(r) for r in ranks[:16]) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    noun = "host" if len(ranks) == 1 else "hosts"
    return f"{wait.what}: {noun} {named} did not {verb} within {wait.deadline_s:g} s"
