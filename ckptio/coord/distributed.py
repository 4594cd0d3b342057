"""Coordination across hosts, borrowed from the framework that is already running.

A save needs only a gather of small JSON-able records (each host's written
objects) to the coordinator (rank 0) and a broadcast of its small verdict;
ckptio takes both from ``torch.distributed`` or ``jax.distributed`` and
never runs a cluster runtime of its own. A single process needs none.

Traffic is O(H) for the job: the coordinator receives H records, and a
non-coordinator receives only the verdict, whatever the number of hosts H.
:meth:`Coordinator.all_gather` (every record to every host, O(H²)) stays
for the callers that truly need everyone's data on every host.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from ckptio.coord.exchange import copy_into, jax_exchange, joined
from ckptio.coord.kvwaits import abort_of, gather_keys, get_within, post_abort, try_get
from ckptio.coord.torchcoord import TorchCoordinator, _Ranked
from ckptio.coord.waits import CollectiveTimeout, Wait, current, missing_message

if TYPE_CHECKING:
    from ckptio.engine import EngineConfig

__all__ = [
    "AllGatherCoordinator",
    "BytesCoordinator",
    "Coordinator",
    "CountingCoordinator",
    "ExchangeCoordinator",
    "JaxCoordinator",
    "SingleProcess",
    "TorchCoordinator",
    "broadcast_from_root",
    "default_coordinator",
    "gather_to_root",
    "join_errors",
]



class AllGatherCoordinator(Protocol):
    """The least a coordinator offers: ``rank``, ``size`` and an all-gather.

    Coordinators written before :class:`Coordinator` grew ``gather`` and
    ``broadcast`` implement only this; :func:`gather_to_root` and
    :func:`broadcast_from_root` still accept them.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every host's JSON-able ``obj``, in rank order. May run off the main thread."""
        ...


class Coordinator(AllGatherCoordinator, Protocol):
    """What a save needs from the cluster. ``rank`` 0 is the coordinator that commits.

    Every host calls the collectives in the same order (each is collective);
    one call at a time per coordinator, from any thread.
    """

    def gather(self, obj: Any) -> list[Any] | None:
        """Every host's JSON-able ``obj`` in rank order on rank 0 (JSON round-tripped); None elsewhere.

        A non-coordinator receives nothing through it.
        """
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's JSON-able ``obj`` on every host (``obj`` is ignored elsewhere).

        A non-coordinator receives rank 0's ``obj`` and a constant overhead: keep it small.
        """
        ...


class BytesCoordinator(Coordinator, Protocol):
    """A :class:`Coordinator` that also broadcasts raw bytes from any host.

    The one coordinator protocol of ckptio: :class:`SingleProcess`,
    :class:`TorchCoordinator` and the tiers' groups
    (:class:`ckptio.tiers.group.PeerGroup` adds point-to-point transfers) all
    satisfy it.
    """

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Host ``src``'s ``data`` on every host; ValueError on every host if ``src`` has None."""
        ...


class ExchangeCoordinator(BytesCoordinator, Protocol):
    """A :class:`BytesCoordinator` that also exchanges byte messages between every pair of hosts."""

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        """All-to-all of byte messages; collective (every host calls it, with its own ``sends``).

        ``sends[dst]``: the message to host ``dst``, the concatenation of its
        buffers (a message to itself is copied). Returns ``{src: message}`` for
        every non-empty message sent to this host. ``sizes``, when every host
        already knows the lengths of the buffers each host sends it
        (``{src: [n, ...]}`` in order, no entry for none), saves the round that
        exchanges lengths and sends the buffers without copying them. Traffic
        per host: what it sends and receives, plus ``8·H`` bytes of lengths.

        A coordinator may also have ``exchange_into(sends, sizes, into)``: the
        same exchange with ``sizes`` given, each source's buffers landing in the
        caller's writable ``into[src]`` (one buffer per length of ``sizes[src]``),
        so a receiver never holds a whole message beside where its bytes go.
        """
        ...


def gather_to_root(coord: AllGatherCoordinator, obj: Any) -> list[Any] | None:
    """``coord.gather(obj)``; for a coordinator without ``gather``, its all-gather (on rank 0 only)."""
    gather = getattr(coord, "gather", None)
    if gather is not None:
        return gather(obj)  # type: ignore[no-any-return]
    everyone = coord.all_gather(obj)
    return everyone if coord.rank == 0 else None


def broadcast_from_root(coord: AllGatherCoordinator, obj: Any) -> Any:
    """``coord.broadcast(obj)``; ``obj`` itself for one host; an all-gather's first for a coordinator
    without ``broadcast``."""
    if coord.size == 1:
        return obj
    broadcast = getattr(coord, "broadcast", None)
    if broadcast is not None:
        return broadcast(obj)
    return coord.all_gather(obj)[0]


def join_errors(errors: list[str], most: int = 8) -> str:
    """Hosts' error messages as one, bounded: a verdict is broadcast to every host, so it must
    not grow with the number of hosts that failed."""
    out = "; ".join(errors[:most])
    return out + (f"; ... and {len(errors) - most} more hosts" if len(errors) > most else "")


class SingleProcess:
    """One host: every collective is an identity (of what :meth:`_wire` makes of the object)."""

    rank = 0
    size = 1

    @staticmethod
    def _wire(obj: Any) -> Any:
        """What an object looks like after a collective; a subclass may round-trip it as a wire would."""
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [self._wire(obj)]

    def gather(self, obj: Any) -> list[Any] | None:
        return [self._wire(obj)]

    def broadcast(self, obj: Any) -> Any:
        return self._wire(obj)

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        if data is None:
            raise ValueError("broadcast_bytes: the source host has no data")
        return bytes(data)

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        mine = joined(sends.get(0, []))
        return {0: mine} if mine else {}

    def exchange_into(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]],
                      into: dict[int, list[memoryview]]) -> None:
        """See :meth:`ExchangeCoordinator.exchange`: the message to itself, copied into ``into[0]``."""
        if 0 in into:
            copy_into(into[0], sends.get(0, []))


class JaxCoordinator(_Ranked):
    """jax.distributed: the coordination service's key-value store.

    Each collective is one numbered operation; its keys live under
    ``<prefix>/op/<n>/``. A gather: every other host sets its key, only
    process 0 reads them (then deletes the directory). A broadcast: process 0
    sets one verdict key, every other host waits on that one key. The
    service keeps keys until deleted; process 0 deletes an operation's
    directory once every host is known to be past it (it has then read
    every host's key of a later operation), so non-coordinators never delete.

    Every wait is under the deadline of :func:`ckptio.coord.waits.waiting_for`
    (:mod:`ckptio.coord.kvwaits`): a host whose key never comes fails the waiting
    hosts with :class:`ckptio.coord.waits.CollectiveTimeout` naming it.
    """

    def __init__(
        self, prefix: str = "ckptio", *, client: Any = None, rank: int | None = None, size: int | None = None
    ) -> None:
        """``client``: a coordination-service client (the API of jax's ``DistributedRuntimeClient``),
        with this process's ``rank`` and the job's ``size``; by default jax.distributed's own."""
        if client is None:
            import jax
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise RuntimeError("jax.distributed is not initialized")
            rank, size = jax.process_index(), jax.process_count()
        elif rank is None or size is None:
            raise ValueError("JaxCoordinator: a client needs this process's rank and the job's size")
        self._client = client
        self._rank, self._size = rank, size
        self._prefix = prefix
        self._n = 0
        self._stale: list[int] = []  # process 0: operations whose keys some host may still read
        self._broken: CollectiveTimeout | None = None
        self._lock = threading.Lock()

    def _next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    def _dir(self, n: int) -> str:
        return f"{self._prefix}/op/{n}"

    def _wait(self, timeout_ms: int | None) -> Wait:
        """This collective's wait (``timeout_ms``, an explicit override, else :func:`ckptio.coord.waits.current`);
        refused after an earlier collective timed out (the hosts are out of step)."""
        if self._broken is not None:
            raise CollectiveTimeout(f"an earlier collective timed out, the hosts are out of step: {self._broken}",
                                    hosts=self._broken.hosts, what=self._broken.what) from self._broken
        wait = current()
        wait = wait if timeout_ms is None else Wait(wait.what, timeout_ms / 1000)
        gone = try_get(self._client, f"{self._prefix}/gone") if self._rank == 0 and self._size > 1 else None
        if gone is not None:  # a host gave up waiting for this one: it will not join this collective
            rank, message = gone.split(":", 1)
            raise self._failed(CollectiveTimeout(f"host {rank} gave up waiting: {message}", hosts=(int(rank),),
                                                 what=wait.what, deadline_s=wait.deadline_s))
        return wait

    def _failed(self, e: CollectiveTimeout) -> CollectiveTimeout:
        self._broken = e
        if self._rank == 0:
            post_abort(self._client, f"{self._prefix}/abort", e)
        return e

    def all_gather(self, obj: Any, timeout_ms: int | None = None) -> list[Any]:
        wait = self._wait(timeout_ms)
        n = self._next()
        key = self._dir(n)
        self._client.key_value_set(f"{key}/{self._rank}", json.dumps(obj))
        try:
            got = gather_keys(self._client, {r: f"{key}/{r}" for r in range(self._size)}, wait)
        except CollectiveTimeout as e:
            raise self._failed(e) from None
        if self._rank == 0:
            self._stale.append(n)  # others may still be reading this one
            self._all_started(n)
        return [json.loads(got[r]) for r in range(self._size)]

    def gather(self, obj: Any, timeout_ms: int | None = None) -> list[Any] | None:
        wait = self._wait(timeout_ms)
        n = self._next()
        key = self._dir(n)
        if self._rank != 0:
            self._client.key_value_set(f"{key}/{self._rank}", json.dumps(obj))
            return None
        try:
            got = gather_keys(self._client, {r: f"{key}/{r}" for r in range(1, self._size)}, wait)
        except CollectiveTimeout as e:
            raise self._failed(e) from None
        out = [json.loads(json.dumps(obj))] + [json.loads(got[r]) for r in range(1, self._size)]
        self._delete(n)  # nobody else reads a gather's keys
        self._all_started(n)
        return out

    def broadcast(self, obj: Any, timeout_ms: int | None = None) -> Any:
        wait = self._wait(timeout_ms)
        n = self._next()
        key = f"{self._dir(n)}/verdict"
        if self._rank != 0:
            return json.loads(self._from_host0(key, wait))
        data = json.dumps(obj)
        if self._size > 1:
            self._client.key_value_set(key, data)
            self._stale.append(n)
        return json.loads(data)

    def _from_host0(self, key: str, wait: Wait) -> str:
        """Host 0's ``key``: two deadlines (host 0 may be waiting one for another host), or the
        abort host 0 left, or CollectiveTimeout naming host 0."""
        for _ in range(2):
            value = get_within(self._client, key, wait, time.monotonic())
            if value is not None:
                return value
            said = abort_of(self._client, f"{self._prefix}/abort", wait)
            if said is not None:
                raise self._failed(said)
        message = missing_message(wait, [0], "answer")
        post_abort(self._client, f"{self._prefix}/gone", CollectiveTimeout(message, hosts=(self._rank,)))
        raise self._failed(CollectiveTimeout(message, hosts=(0,), what=wait.what, deadline_s=wait.deadline_s))

    #: Every byte is relayed through the coordination service (process 0): read-once only when asked.
    bulk_exchange = False

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None,
                 timeout_ms: int | None = None) -> dict[int, bytearray]:
        """See :meth:`ExchangeCoordinator.exchange` and :func:`ckptio.coord.exchange.jax_exchange`."""
        wait = self._wait(timeout_ms)
        return jax_exchange(self._client, self._dir(self._next()), self._rank, sends, sizes,
                            int(wait.deadline_s * 1000))

    def exchange_into(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]],
                      into: dict[int, list[memoryview]], timeout_ms: int | None = None) -> None:
        """See :meth:`ExchangeCoordinator.exchange` and :func:`ckptio.coord.exchange.jax_exchange`."""
        wait = self._wait(timeout_ms)
        jax_exchange(self._client, self._dir(self._next()), self._rank, sends, sizes, int(wait.deadline_s * 1000),
                     into)

    def _all_started(self, n: int) -> None:
        """Process 0, having read every host's key of operation ``n``: every host is past the earlier ones."""
        keep = [m for m in self._stale if m >= n]
        for m in self._stale:
            if m < n:
                self._delete(m)
        self._stale = keep

    def _delete(self, n: int) -> None:
        try:
            self._client.key_value_delete(self._dir(n))  # the directory and every key under it
        except Exception:  # an older jax without deletes: keep the keys, lose nothing
            pass


class CountingCoordinator:
    """Wraps a coordinator and counts the payload bytes this host receives through it.

    What a collective hands back that came from other hosts, as JSON:
    other hosts' records from ``all_gather`` (and from ``gather`` on rank 0),
    rank 0's object from ``broadcast`` on other hosts. The framework's own
    framing is not counted (a constant per call; count the sockets for it).
    """

    def __init__(self, inner: AllGatherCoordinator) -> None:
        self.inner = inner
        self.received = 0
        self.calls: dict[str, int] = {"all_gather": 0, "gather": 0, "broadcast": 0}

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _others(self, everyone: list[Any]) -> int:
        return sum(len(json.dumps(o)) for r, o in enumerate(everyone) if r != self.rank)

    def all_gather(self, obj: Any) -> list[Any]:
        self.calls["all_gather"] += 1
        out = self.inner.all_gather(obj)
        self.received += self._others(out)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        self.calls["gather"] += 1
        out = gather_to_root(self.inner, obj)
        if out is not None:
            self.received += self._others(out)
        return out

    def broadcast(self, obj: Any) -> Any:
        self.calls["broadcast"] += 1
        out = broadcast_from_root(self.inner, obj)
        if self.rank != 0:
            self.received += len(json.dumps(out))
        return out


_default: Coordinator | None = None


def default_coordinator() -> Coordinator:
    """torch.distributed if initialized, else jax.distributed if initialized, else a single process.

    Frameworks are consulted only if already imported: ckptio never imports them itself.
    """
    global _default
    if _default is not None:
        return _default
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            _default = TorchCoordinator()
            return _default
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            if jax.process_count() > 1:
                _default = JaxCoordinator()
                return _default
        except RuntimeError:
            pass
    return SingleProcess()


def reset_default_coordinator() -> None:
    """Forget the cached coordinator (after a process group is destroyed)."""
    global _default
    _default = None


def config_for_host(config: EngineConfig | None, coordinator: AllGatherCoordinator | None) -> EngineConfig | None:
    """``config`` with this host's share of its request budget: rank and size from ``coordinator``
    (None: :func:`default_coordinator`); as is without a budget, or one that names its host."""
    if config is None or config.request_rate is None or config.request_rate.hosts is not None:
        return config
    coord = coordinator or default_coordinator()
    return config.for_host(coord.rank, coord.size)
