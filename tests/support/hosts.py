"""Several hosts of one job as threads of this process (lives in ckptio.bench.threadhosts)."""

from __future__ import annotations

from typing import Any

from ckptio.bench.threadhosts import _ThreadGroup, on_hosts

__all__ = ["TierGroup", "_ThreadGroup", "on_hosts"]  # _ThreadGroup: for workers/paused_save_worker.py


class TierGroup:
    """One thread-host's side of the collectives a tiered restore's manifest takes, over an all-gather
    (tests/support/hosts.py); :attr:`received` counts the bytes others sent this host."""

    def __init__(self, member: Any) -> None:
        self.m, self.rank, self.size = member, member.rank, member.size
        self.received = 0

    def gather(self, obj: Any) -> list[Any] | None:
        everyone = self.m.all_gather(obj)
        return everyone if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        return self.m.all_gather(obj)[0]

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        got = self.m.all_gather(data.hex() if data is not None else None)[src]
        if got is None:
            raise ValueError(f"broadcast_bytes: host {src} has no data")
        if src != self.rank:
            self.received += len(got) // 2
        return bytes.fromhex(got)

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        out = {str(d): b"".join(bytes(b) for b in bufs).hex() for d, bufs in sends.items()}
        everyone = self.m.all_gather(out)
        got = {s: bytearray.fromhex(m[str(self.rank)]) for s, m in enumerate(everyone) if m.get(str(self.rank))}
        if sizes is not None:
            assert {s: len(b) for s, b in got.items()} == {s: sum(n) for s, n in sizes.items() if sum(n)}, sizes
        self.received += sum(len(b) for s, b in got.items() if s != self.rank)
        return got
