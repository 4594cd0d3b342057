"""All-to-all byte exchanges on the frameworks' collectives: the transport of a read-once restore.

:class:`ckptio.coord.distributed.ExchangeCoordinator` says what an exchange is;
here are its two transports. torch: one ``all_to_all_single`` of lengths
(gloo has it on CPU) then isend/irecv pairs, zero copy where the caller gives
the receivers' cut. jax: the coordination service's key-value store
(``key_value_set_bytes`` / ``blocking_key_value_get_bytes``): O(own bytes)
per host, but every byte passes through the service on process 0, so it
suits metadata-sized exchanges and small jobs, not the bulk of a large
restore (that wants device collectives: see the notes in
:mod:`ckptio.restoring.boxexchange`). Frameworks are imported only when called.
"""

from __future__ import annotations

import collections
from typing import Any

from ckptio.system import flat_bytes
from ckptio.system.bytes import gather_bytes

__all__ = ["copy_into", "jax_exchange", "joined", "torch_exchange"]

#: gloo point-to-point tag of an exchange's messages (apart from the gather's).
_TAG = 0x6378
#: A tensor sent or received at once is at most this large (gloo never sees 2 GiB).
_PIECE = 16 << 20
#: A key-value entry of the jax coordination service holds at most this much (gRPC messages
#: have size limits; the service is not a bulk transport).
_KV_PIECE = 1 << 20


def joined(buffers: list[memoryview]) -> bytearray:
    """One buffer holding ``buffers`` one after another (no copy for one whole bytearray)."""
    if len(buffers) == 1 and isinstance(buffers[0].obj, bytearray) and buffers[0].nbytes == len(buffers[0].obj):
        return buffers[0].obj
    return gather_bytes([flat_bytes(b) for b in buffers])


def _writable(b: memoryview) -> memoryview:
    """``b`` as flat bytes torch can wrap (it wants writable memory, even to send)."""
    return flat_bytes(b) if not b.readonly else memoryview(bytearray(b))


def _tensors(torch: Any, buf: memoryview, lengths: list[int]) -> list[Any]:
    """``buf`` cut at ``lengths`` (the sender's buffers), each cut again at :data:`_PIECE`, as uint8
    tensors: both ends of a message cut it alike, so every send meets a receive of its size."""
    out, pos = [], 0
    for n in lengths:
        out += [torch.frombuffer(buf, dtype=torch.uint8, count=min(_PIECE, n - lo), offset=pos + lo)
                for lo in range(0, n, _PIECE)]
        pos += n
    return out


def copy_into(into: list[memoryview], sends: list[memoryview]) -> None:
    """The bytes of ``sends``, one after another, into the buffers ``into`` (the same total, cut
    anywhere): a message to oneself, landing where a receiver wants it."""
    dst = [flat_bytes(v) for v in into if v.nbytes]
    i, at = 0, 0
    for b in sends:
        src, pos = flat_bytes(b), 0
        while pos < src.nbytes:
            n = min(src.nbytes - pos, dst[i].nbytes - at)
            dst[i][at : at + n] = src[pos : pos + n]
            pos, at = pos + n, at + n
            if at == dst[i].nbytes:
                i, at = i + 1, 0


def torch_exchange(group: Any, global_ranks: list[int], rank: int, sends: dict[int, list[memoryview]],
                   sizes: dict[int, list[int]] | None, into: dict[int, list[memoryview]] | None = None
                   ) -> dict[int, bytearray]:
    """An exchange over a gloo ``group`` (``global_ranks``: its ranks in the job): lengths by one
    ``all_to_all_single`` unless ``sizes`` gives them, then every buffer as isend/irecv pairs, all
    posted at once (no order between pairs, so no deadlock whatever the pattern). The caller
    serializes calls on the group. ``into`` (with ``sizes``): the caller's buffers that each
    source's buffers land in, one per length of ``sizes[src]`` (no message of theirs returned)."""
    import torch
    import torch.distributed as dist

    if into is not None:
        assert sizes is not None, "receiving into the caller's buffers needs their sizes"
        works = [dist.irecv(t, global_ranks[r], group=group, tag=_TAG)
                 for r, views in into.items() if r != rank for v in views if v.nbytes
                 for t in _tensors(torch, flat_bytes(v), [v.nbytes])]
        works += [dist.isend(t, global_ranks[r], group=group, tag=_TAG) for r, bufs in sends.items() if r != rank
                  for b in bufs if b.nbytes for t in _tensors(torch, _writable(b), [b.nbytes])]
        for w in works:
            w.wait()
        if rank in into:
            copy_into(into[rank], sends.get(rank, []))
        return {}
    size = len(global_ranks)
    if sizes is None:  # one buffer per message, the receiver learns its length
        sends = {r: [memoryview(joined(b))] for r, b in sends.items() if sum(v.nbytes for v in b)}
        got = torch.zeros(size, dtype=torch.int64)
        lengths = [sum(v.nbytes for v in sends.get(r, [])) for r in range(size)]
        dist.all_to_all_single(got, torch.tensor(lengths, dtype=torch.int64), group=group)
        sizes = {r: [int(n)] for r, n in enumerate(got.tolist()) if n}
    out = {r: bytearray(sum(n)) for r, n in sizes.items() if sum(n) and r != rank}
    works = [dist.irecv(t, global_ranks[r], group=group, tag=_TAG)
             for r, buf in out.items() for t in _tensors(torch, memoryview(buf), sizes[r])]
    works += [dist.isend(t, global_ranks[r], group=group, tag=_TAG)
              for r, bufs in sends.items() if r != rank for b in bufs for t in _tensors(torch, _writable(b), [b.nbytes])]
    for w in works:
        w.wait()
    mine = joined(sends.get(rank, []))
    if mine:
        out[rank] = mine
    return out


def jax_exchange(client: Any, base: str, rank: int, sends: dict[int, list[memoryview]],
                 sizes: dict[int, list[int]] | None, timeout_ms: int,
                 into: dict[int, list[memoryview]] | None = None) -> dict[int, bytearray]:
    """An exchange through the jax coordination service's key-value store, under key ``base``
    (unique to this exchange): each message as ``<base>/to/<dst>/<src>/<piece>``. Without
    ``sizes`` a barrier says every message is set, then each host lists its own directory;
    with them it waits on exactly the keys it expects. Each host deletes its own directory."""
    for dst, bufs in sends.items():
        data = joined(bufs) if dst != rank else b""
        for i, lo in enumerate(range(0, len(data), _KV_PIECE)):
            client.key_value_set_bytes(f"{base}/to/{dst}/{rank}/{i:09d}", bytes(data[lo : lo + _KV_PIECE]))
    out: dict[int, bytearray] = {}
    if sizes is None:
        client.wait_at_barrier(f"{base}/sent", timeout_ms)
        pieces: dict[int, list[tuple[int, bytes]]] = collections.defaultdict(list)
        for key, value in client.key_value_dir_get_bytes(f"{base}/to/{rank}/"):
            src, i = key.rstrip("/").split("/")[-2:]
            pieces[int(src)].append((int(i), value))
        out = {src: bytearray(b"".join(v for _, v in sorted(p))) for src, p in pieces.items()}
    else:
        for src, lengths in sizes.items():
            total = sum(lengths)
            if src == rank or not total:
                continue
            buf = out[src] = bytearray(total) if into is None or src not in into else bytearray()
            values = []
            for i, lo in enumerate(range(0, total, _KV_PIECE)):
                value = client.blocking_key_value_get_bytes(f"{base}/to/{rank}/{src}/{i:09d}", timeout_ms)
                if into is not None and src in into:
                    values.append(memoryview(value))
                else:
                    buf[lo : lo + len(value)] = value
            if values:
                copy_into(into[src], values)  # type: ignore[index]
                del out[src]
    try:
        client.key_value_delete(f"{base}/to/{rank}")  # the directory: only this host reads it
    except Exception:  # an older jax without deletes: keep the keys, lose nothing
        pass
    if into is not None and rank in into:
        copy_into(into[rank], sends.get(rank, []))
        return out
    mine = joined(sends.get(rank, []))
    if mine:
        out[rank] = mine
    return out
