"""Status rounds of a collective restore: every host learns whether any host failed, and raises.

A read-once restore (:mod:`ckptio.restoring.boxexchange`, and the DCP Reader's
read-once through it) is a sequence of collectives; a host that fails (a
missing object, a checksum, a bad target) must not leave the others waiting
for bytes that never come, and every host must raise the same kind of error
so that the step fallback of :mod:`ckptio.restoring.step` makes one decision.
So each phase ends in a status round: a gather to host 0 and a broadcast of
its verdict (bounded: the first failures' messages, not every host's).
"""

from __future__ import annotations

from ckptio.backends.base import RetryableError, ThrottledError
from ckptio.coord.distributed import Coordinator, broadcast_from_root, gather_to_root, join_errors
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError

__all__ = ["agree", "can_read_once", "kind_of", "named", "of_kind"]

#: Error kinds carried across hosts as themselves, by the read-once status rounds here and host 0's
#: choice of the step (ckptio.restoring.step): every host makes the same step decision, and a storage
#: outage (a throttle past its patience, a retryable failure) is one on every host.
_KINDS: dict[str, type[BaseException]] = {
    "ThrottledError": ThrottledError,
    "RetryableError": RetryableError,
    "CheckpointNotFoundError": CheckpointNotFoundError,
    "IntegrityError": IntegrityError,
    "ManifestError": ManifestError,
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
}


def can_read_once(coord: Coordinator) -> bool:
    """Whether ``coord`` spans several hosts and exchanges bytes (see
    :class:`ckptio.coord.distributed.ExchangeCoordinator`)."""
    return coord.size > 1 and callable(getattr(coord, "exchange", None))


def named(e: BaseException, rank: int) -> BaseException:
    """``e`` with this host's rank in its message (its type kept when it can be rebuilt)."""
    try:
        out = type(e)(f"host {rank}: {e}")
    except Exception:
        return e
    out.__dict__.update(e.__dict__)
    out.__cause__ = e
    return out


def kind_of(e: BaseException) -> str:
    """The most specific kind of ``e`` that other hosts re-raise as itself ("" for none of them)."""
    return next((c.__name__ for c in type(e).__mro__ if c.__name__ in _KINDS), "")


def of_kind(kind: str, message: str, default: type[BaseException]) -> BaseException:
    """The error another host raises for a failure of ``kind`` (:func:`kind_of`): that kind, else ``default``."""
    return _KINDS.get(kind, default)(message)


def agree(coord: Coordinator, failure: BaseException | None, n: int) -> int:
    """Status round (collective): every host learns whether any host failed (then raises: its own
    failure, else the first one's kind naming the host at fault) and the largest ``n``."""
    mine = [n, None if failure is None else [kind_of(failure) or "RuntimeError",
                                             f"host {coord.rank}: {type(failure).__name__}: {failure}"]]
    reports = gather_to_root(coord, mine)
    verdict = None
    if reports is not None:
        errors = [r[1] for r in reports if r[1]]
        verdict = [max(r[0] for r in reports), errors[0][0] if errors else "", join_errors([m for _, m in errors])]
    most, kind, message = broadcast_from_root(coord, verdict)
    if not kind:
        return int(most)
    raise failure or of_kind(kind, f"read-once restore failed on another host: {message}", RuntimeError)
