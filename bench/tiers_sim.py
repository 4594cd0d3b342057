"""The tiers' simulated job (``ckptio bench --tiers-scale``): the steps every host holds, the
coordinator's collectives played from recorded messages, and each host's objects as sparse files."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["COLS", "DURABLE_STEP", "NEWEST", "OLDER", "SimGroup", "objects_of"]


#: The two newest steps every surviving host holds; the lost host's shards of NEWEST are on its partner.
OLDER, NEWEST, DURABLE_STEP = 9, 10, 8


#: Columns of every array (bench/scale.py's state, narrower: the records' size is in the shards, not the bytes).
COLS = 1024


class SimGroup:
    """Host ``rank`` of a job of ``size`` hosts; the others are played from ``others`` and ``replay``.

    ``others[r]`` is what host ``r`` contributes to a gather or all-gather; ``replay`` holds, in order,
    what the coordinator broadcast in its own run (a non-coordinator receives them); on the coordinator,
    :attr:`broadcasts` records them. :attr:`received` counts the bytes this host receives (JSON, as
    the real groups send them; framing not counted), :attr:`sent` what it sends.
    """

    def __init__(self, rank: int, size: int, others: Sequence[Any], replay: Sequence[bytes] = ()) -> None:
        self.rank, self.size = rank, size
        self._others = others
        self._replay = list(replay)
        self.broadcasts: list[bytes] = []
        self.received = 0
        self.sent = 0

    def _everyone(self, obj: Any) -> list[Any]:
        out = []
        for r in range(self.size):
            if r == self.rank:
                out.append(json.loads(json.dumps(obj)))
            else:
                data = json.dumps(self._others[r])
                self.received += len(data)
                out.append(json.loads(data))
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        self.sent += len(json.dumps(obj)) * (self.size - 1)
        return self._everyone(obj)

    def gather(self, obj: Any) -> list[Any] | None:
        if self.rank != 0:
            self.sent += len(json.dumps(obj))
            return None
        return self._everyone(obj)

    def broadcast(self, obj: Any) -> Any:
        return json.loads(self.broadcast_bytes(json.dumps(obj).encode() if self.rank == 0 else None, 0))

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        if src != 0:
            raise NotImplementedError("the simulation replays the coordinator's broadcasts only")
        if self.rank == 0:
            if data is None:
                raise ValueError("broadcast_bytes: the source host has no data")
            self.broadcasts.append(bytes(data))
            self.sent += len(data) * (self.size - 1)
            return bytes(data)
        got = self._replay.pop(0)
        self.received += len(got)
        return got

    #: The host whose messages from the coordinator the coordinator's run records for replay.
    WATCHED = 1

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        """Host-to-host messages: only those from the coordinator are played (what the fast tier's commit
        sends); the coordinator records its message to :attr:`WATCHED` for that host's replay."""
        if self.rank == 0:
            for dst, bufs in sends.items():
                data = b"".join(bytes(b) for b in bufs)
                if dst != 0:
                    self.sent += len(data)
                if dst == self.WATCHED and data:
                    self.broadcasts.append(data)
            return {0: bytearray(b"".join(bytes(b) for b in sends[0]))} if sends.get(0) else {}
        if sizes is None or set(sizes) - {0} or sends:
            raise NotImplementedError("the simulation plays only messages from the coordinator, of known sizes")
        if not sizes.get(0) or not sum(sizes[0]):
            return {}
        got = self._replay.pop(0)
        assert len(got) == sum(sizes[0]), (len(got), sizes)
        self.received += len(got)
        return {0: bytearray(got)}

    def transfer(self, messages: Any, provide: Any, deliver: Any) -> None:
        raise NotImplementedError("the simulation moves no bytes between hosts")


def objects_of(root: str, record: dict[str, Any]) -> None:
    """Host ``record``'s objects in its fast tier at ``root``, sparse files of the bytes its extents need."""
    need = [0] * len(record["objects"])
    for item in record["items"].values():
        for shard in item.get("shards") or ():
            for obj, offset, _shard_offset, length, *_crcs in shard["extents"]:  # manifest.extent_json's rows
                need[obj] = max(need[obj], offset + length)
    for key, n in zip(record["objects"], need):
        path = os.path.join(root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(n)
