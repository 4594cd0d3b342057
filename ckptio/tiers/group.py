"""The collectives the tiers need: gather, broadcast, and point-to-point byte transfers.

Each :class:`TorchGroup` is a dedicated gloo group of ``torch.distributed``
(the distributed engine the job already runs): the manager makes one per
thread that talks to other hosts (saves, the caller's restores, the peer
replicator, the durable replicator), because collectives on one group must
be issued in the same order on every host, and two threads sharing a group
could interleave theirs differently on different hosts.

A process without ``torch.distributed`` gets a :class:`LocalGroup` of one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ckptio.coord.distributed import ExchangeCoordinator, SingleProcess, TorchCoordinator
from ckptio.system import flat_bytes

__all__ = ["LocalGroup", "Message", "PeerGroup", "TorchGroup", "refuse_other_multihost", "torch_world"]

#: Point-to-point messages travel in chunks of at most this many bytes, so that reading the
#: next chunk from storage overlaps sending this one (and gloo never sees a 2 GiB buffer).
CHUNK = 16 << 20
#: Sends in flight per host beyond the one being read.
_SEND_DEPTH = 2


@dataclasses.dataclass(frozen=True, order=True)
class Message:
    """``nbytes`` bytes from host ``src`` to host ``dst``; ``order`` is global across all messages.

    Every host sends its messages and receives its messages in ``order``; a
    blocked send then always waits on a message that comes earlier in that
    order, so the transfer cannot deadlock whatever the pattern.
    """

    order: tuple[int, ...]
    src: int
    dst: int
    nbytes: int
    tag: Any = dataclasses.field(default=None, compare=False)


class PeerGroup(ExchangeCoordinator, Protocol):
    """What the tiers need from the hosts of a job: ckptio's coordinator (with its exchange), plus byte
    transfers between hosts."""

    def transfer(
        self,
        messages: Sequence[Message],
        provide: Callable[[Message], Iterable[memoryview]],
        deliver: Callable[[Message, bytearray], None],
    ) -> None:
        """Send this host's messages and receive its own.

        ``provide(m)`` yields ``m``'s bytes in chunks of at most :data:`CHUNK`
        (read lazily, so reading overlaps sending); ``deliver(m, buf)`` takes
        each received message whole.
        """
        ...


class LocalGroup(SingleProcess):
    """One host: collectives are identities, and there is nobody to exchange bytes with.

    Objects go through JSON as they would between hosts, so a single-host run sees what a job does.
    """

    @staticmethod
    def _wire(obj: Any) -> Any:
        return json.loads(json.dumps(obj))

    def transfer(
        self,
        messages: Sequence[Message],
        provide: Callable[[Message], Iterable[memoryview]],
        deliver: Callable[[Message, bytearray], None],
    ) -> None:
        if messages:
            raise ValueError("a single host has no peer to exchange bytes with")


def torch_world() -> tuple[int, int] | None:
    """``(rank, size)`` of an initialized torch.distributed job of more than one process, else None.

    Looks only at an already imported torch: ckptio never imports a framework itself.
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    size = torch.distributed.get_world_size()
    return (torch.distributed.get_rank(), size) if size > 1 else None


def refuse_other_multihost() -> None:
    """Peers talk over torch.distributed only: a multi-process JAX job without it would have every
    host commit a manifest of its own shards alone, so it is refused rather than half-working."""
    import sys

    jax = sys.modules.get("jax")
    try:
        multi = jax is not None and jax.process_count() > 1
    except RuntimeError:
        multi = False
    if multi:
        raise NotImplementedError(
            "TieredCheckpointManager needs torch.distributed (gloo) across hosts; this is a multi-process "
            "JAX job without it")


class TorchGroup(TorchCoordinator):
    """A dedicated gloo group over every process of the job: the coordinator's collectives
    (gather, broadcast, all-gather, byte broadcast), plus the byte transfers peer replication needs.

    Construct on every host at the same point (creating a group is a collective).
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        import datetime

        import torch.distributed as dist

        kwargs: dict[str, Any] = {"backend": "gloo"}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        super().__init__(dist.new_group(**kwargs))

    def transfer(
        self,
        messages: Sequence[Message],
        provide: Callable[[Message], Iterable[memoryview]],
        deliver: Callable[[Message, bytearray], None],
    ) -> None:
        """Sends run on a helper thread and receives on this one, each in global ``order``.

        A sender holds a few chunks at a time: the next chunk is read while
        the previous ones are on the wire. A receiver posts every chunk of a
        message at once (into the message's own buffer) and hands the message
        to ``deliver`` as soon as it is in. If ``provide`` fails, zeros make
        up the rest of the message (the receiver must not hang) and the
        error is raised after the transfer; the caller's status round tells
        the receivers to discard what they got.
        """
        mine_out = sorted(m for m in messages if m.src == self._rank)
        mine_in = sorted(m for m in messages if m.dst == self._rank)
        if any(m.src == m.dst for m in mine_out):
            raise ValueError("a host does not send messages to itself")
        errors: list[BaseException] = []

        def send_all() -> None:
            inflight: collections.deque[Any] = collections.deque()
            for m in mine_out:
                for chunk in self._chunks_of(m, provide, errors):
                    t = self._torch.frombuffer(chunk, dtype=self._torch.uint8)
                    work = self._dist.isend(t, self._global[m.dst], group=self.group)
                    assert work is not None
                    inflight.append((work, t))  # t keeps the chunk alive until its send is done
                    while len(inflight) > _SEND_DEPTH:
                        inflight.popleft()[0].wait()
            while inflight:
                inflight.popleft()[0].wait()

        sender = threading.Thread(target=self._guard(send_all, errors), name="ckptio-peer-send", daemon=True)
        sender.start()
        try:
            for m in mine_in:
                buf = bytearray(m.nbytes)
                works = [
                    self._dist.irecv(self._torch.frombuffer(buf, dtype=self._torch.uint8,
                                                            count=min(CHUNK, m.nbytes - lo), offset=lo),
                                     self._global[m.src], group=self.group)
                    for lo in range(0, m.nbytes, CHUNK)
                ]
                for w in works:
                    assert w is not None
                    w.wait()
                deliver(m, buf)
        finally:
            sender.join()
        if errors:
            raise errors[0]

    @staticmethod
    def _chunks_of(
        m: Message, provide: Callable[[Message], Iterable[memoryview]], errors: list[BaseException]
    ) -> Iterable[memoryview]:
        """``m``'s bytes in the chunks a receiver expects (cut at :data:`CHUNK`), writable for torch."""
        sent = 0
        try:
            for part in provide(m):
                flat = flat_bytes(part)
                for lo in range(0, flat.nbytes, CHUNK):
                    piece = flat[lo : lo + CHUNK]
                    if sent + piece.nbytes > m.nbytes or (piece.nbytes != CHUNK and sent + piece.nbytes != m.nbytes):
                        raise ValueError(f"message {m.tag!r}: provided chunks do not cut {m.nbytes} bytes at {CHUNK}")
                    # torch.frombuffer wants a writable buffer (sends only read it).
                    yield piece if not piece.readonly else memoryview(bytearray(piece))
                    sent += piece.nbytes
        except BaseException as e:  # keep the stream aligned for the receiver
            errors.append(e)
        while sent < m.nbytes:
            n = min(CHUNK, m.nbytes - sent)
            yield memoryview(bytearray(n))
            sent += n

    @staticmethod
    def _guard(fn: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        return run
