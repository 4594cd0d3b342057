"""torch.distributed as a :class:`ckptio.coord.distributed.Coordinator` (re-exported there)."""

from __future__ import annotations

import json
import threading
from typing import Any

from ckptio.coord.exchange import torch_exchange
from ckptio.coord.storegate import StoreGate

__all__ = ["TorchCoordinator"]

#: Broadcasts travel in pieces of at most this many bytes (gloo never sees a 2 GiB buffer).
_BROADCAST_CHUNK = 16 << 20
#: gloo point-to-point tag of the gather's messages: apart from any other sends on the group.
_GATHER_TAG = 0x636B


class _Ranked:
    """``rank`` and ``size`` of a coordinator that learned them at construction."""

    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size


class TorchCoordinator(_Ranked):
    """torch.distributed: a dedicated gloo group, so background collectives never
    interleave with the training step's collectives on the default group.

    ``gather`` is point-to-point to rank 0 (each host sends its length, then its
    bytes), not ``gather_object``: that one all-gathers every host's length
    first (8·H bytes to every host) and pads every record to the longest.

    Every collective first checks every host in through the torch store
    (:class:`ckptio.coord.storegate.StoreGate`), under the deadline of
    :func:`ckptio.coord.waits.waiting_for`: a host that never arrives fails the others
    with :class:`ckptio.coord.waits.CollectiveTimeout` naming it, instead of hanging
    them until the process group's timeout.

    Construct it on every rank at the same point (creating a group is collective).
    """

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        # Point-to-point and broadcast name peers by global rank (a given group need not span the job).
        self._global = [dist.get_global_rank(self.group, r) for r in range(self._size)]
        self._lock = threading.Lock()
        # A connection of its own: a store client serves one request at a time, and this one blocks
        # in waits that must not stall other threads' store requests (another group's gate, torch's).
        store = dist.distributed_c10d._get_default_store()
        store = store.clone() if hasattr(store, "clone") else store
        store = dist.PrefixStore(f"ckptio/{self.group.group_name}", store)
        self._gate = StoreGate(store, self._rank, self._size)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        with self._lock:  # one collective at a time on the group, whatever thread calls
            self._gate.enter()
            self._dist.all_gather_object(out, json.dumps(obj), group=self.group)
        return [json.loads(o) for o in out]

    def gather(self, obj: Any) -> list[Any] | None:
        torch, dist = self._torch, self._dist
        data = json.dumps(obj).encode()
        root = self._global[0]
        with self._lock:
            self._gate.enter()
            if self._rank != 0:
                dist.send(torch.tensor([len(data)], dtype=torch.int64), root, group=self.group, tag=_GATHER_TAG)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), root, group=self.group,
                          tag=_GATHER_TAG)
                return None
            peers = range(1, self._size)
            lengths = {r: torch.zeros(1, dtype=torch.int64) for r in peers}
            self._wait([dist.irecv(lengths[r], self._global[r], group=self.group, tag=_GATHER_TAG) for r in peers])
            bufs = {r: bytearray(int(lengths[r].item())) for r in peers}
            self._wait([
                dist.irecv(torch.frombuffer(bufs[r], dtype=torch.uint8), self._global[r], group=self.group,
                           tag=_GATHER_TAG)
                for r in peers
            ])
        return [json.loads(data)] + [json.loads(bufs[r]) for r in peers]

    def broadcast(self, obj: Any) -> Any:
        return json.loads(self.broadcast_bytes(json.dumps(obj).encode() if self._rank == 0 else None, 0))

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Host ``src``'s ``data`` on every host; ValueError on every host if ``src`` has None."""
        torch = self._torch
        with self._lock:
            self._gate.enter()
            n = torch.tensor([len(data) if (self._rank == src and data is not None) else -1], dtype=torch.int64)
            self._dist.broadcast(n, src=self._global[src], group=self.group)
            size = int(n.item())
            if size < 0:
                raise ValueError(f"broadcast_bytes: host {src} has no data")
            buf = bytearray(data) if self._rank == src and data is not None else bytearray(size)
            for lo in range(0, size, _BROADCAST_CHUNK):
                t = torch.frombuffer(buf, dtype=torch.uint8, count=min(_BROADCAST_CHUNK, size - lo), offset=lo)
                self._dist.broadcast(t, src=self._global[src], group=self.group)
        return bytes(buf)

    #: Bytes go host to host (gloo all_to_all / isend-irecv): read-once restores by default.
    bulk_exchange = True

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        """See :meth:`ExchangeCoordinator.exchange` and :func:`ckptio.coord.exchange.torch_exchange`."""
        with self._lock:
            self._gate.enter()
            return torch_exchange(self.group, self._global, self._rank, sends, sizes)

    def exchange_into(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]],
                      into: dict[int, list[memoryview]]) -> None:
        """See :meth:`ExchangeCoordinator.exchange` and :func:`ckptio.coord.exchange.torch_exchange`."""
        with self._lock:
            self._gate.enter()
            torch_exchange(self.group, self._global, self._rank, sends, sizes, into)

    @staticmethod
    def _wait(works: list[Any]) -> None:
        for w in works:
            w.wait()
