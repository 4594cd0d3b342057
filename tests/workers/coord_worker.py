"""One process of a multi-process coordination measurement (launched by tests/coord/test_distributed.py).

usage: coord_worker.py torch|jax ROOT PORT [restore]    (RANK and WORLD_SIZE in the env)

Initializes the framework's runtime (torch gloo, or jax.distributed on CPU),
checks the default coordinator's gather / broadcast / all_gather, then
measures what this process receives:

* ``collective``: one gather of a save-sized record plus one broadcast of a
  verdict, straight on the coordinator;
* ``save``: one real ``ckptio.save`` (after a first, warm-up save: the group's
  connections are set up once per job, not per save), through a
  :class:`ckptio.coord.distributed.CountingCoordinator`.

Each is counted twice: the payload the coordinator hands back from other
hosts (the counting wrapper), and the TCP payload bytes the kernel counted
on every socket of this process (``tcpi_bytes_received``: the framework's
framing included, nothing of ours trusted). The saved step is then restored
with another split and checked bit-exact. Prints one JSON line.

With ``restore``, it only restores step 2 (saved by any number of
processes) with this job's column split, and checks it bit-exact.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

SHAPE = (64, 48)
#: Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info`` (since 4.1).
_TCPI_BYTES_RECEIVED = 128


def tcp_bytes_received() -> int:
    """TCP payload bytes received so far on every TCP socket this process holds open."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)  # a duplicate: closed below
        except OSError:  # closed meanwhile
            continue
        try:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            if len(info) >= _TCPI_BYTES_RECEIVED + 8:
                total += struct.unpack_from("<Q", info, _TCPI_BYTES_RECEIVED)[0]
        except OSError:  # not a TCP socket (a unix socket, a pipe's peer)
            pass
        finally:
            s.close()
    return total


def full() -> np.ndarray:
    return np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)


def state_of(rank: int, world: int) -> dict[str, Any]:
    """This host's row block of ``w``, plus a replicated array: a save's usual record."""
    import ckptio

    rows = SHAPE[0] // world
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    return {"w": ckptio.Sharded(SHAPE, np.float32, [(ix, full()[ix])]), "r": np.arange(10, dtype=np.int64)}


def check_collectives(coord: Any, rank: int, world: int) -> None:
    """gather / broadcast / all_gather give what their contracts say, in a mixed sequence."""
    for round_ in range(2):
        got = coord.gather({"rank": rank, "pad": "x" * rank, "round": round_})
        want = [{"rank": r, "pad": "x" * r, "round": round_} for r in range(world)]
        assert got == (want if rank == 0 else None), (rank, got)
        v = coord.broadcast({"ok": True, "round": round_} if rank == 0 else {"ok": False})
        assert v == {"ok": True, "round": round_}, (rank, v)
        assert coord.all_gather([rank, round_]) == [[r, round_] for r in range(world)]


def measure(run: Callable[[], object], barrier: Callable[[], None]) -> int:
    """TCP bytes this process receives while ``run`` runs (between two barriers, so no one else's)."""
    barrier()
    before = tcp_bytes_received()
    run()
    after = tcp_bytes_received()
    barrier()
    return after - before


def main() -> int:
    mode, root, port = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    barrier: Callable[[], None]
    if mode == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        barrier = dist.barrier
    else:
        import jax

        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
        from jax._src import distributed as jd

        client = jd.global_state.client
        n_barrier = iter(range(1_000_000))

        def barrier() -> None:
            client.wait_at_barrier(f"coord_worker/{next(n_barrier)}", 120_000)

    import ckptio
    from ckptio.coord.distributed import CountingCoordinator, default_coordinator

    if sys.argv[4:] == ["restore"]:
        check_restore(root, rank, world)
        barrier()
        print(json.dumps({"rank": rank, "size": world, "restored": True}), flush=True)
        return shutdown(mode)
    coord = default_coordinator()
    assert coord.size == world and coord.rank == rank, (coord.size, coord.rank)
    check_collectives(coord, rank, world)

    # A gather of a save-sized record and a broadcast of a verdict, straight on the coordinator.
    record = {"ok": True, "objects": [f"k/{rank}/{i}" for i in range(64)]}
    counted = CountingCoordinator(coord)
    coll_tcp = measure(lambda: (counted.gather(record), counted.broadcast({"ok": True})), barrier)
    coll_payload = counted.received

    state = state_of(rank, world)
    ckptio.save(root, state, step=1).result()  # warm-up: the save path's first use of the group
    counted = CountingCoordinator(coord)
    save_tcp = measure(lambda: ckptio.save(root, state, step=2, coordinator=counted).result(), barrier)

    check_restore(root, rank, world)  # the counted save restores bit-exact with another split
    barrier()
    print(json.dumps({
        "rank": rank, "size": world,
        "collective": {"payload": coll_payload, "tcp": coll_tcp},
        "save": {"payload": counted.received, "tcp": save_tcp, "calls": counted.calls},
    }), flush=True)
    return shutdown(mode)


def check_restore(root: str, rank: int, world: int) -> None:
    """Restore step 2 split by columns over this job (it was saved split by rows), bit-exact."""
    import ckptio

    cols = SHAPE[1] // world
    ix = (slice(None), slice(rank * cols, (rank + 1) * cols))
    out = ckptio.restore(root, step=2, target={"w": ckptio.Sharded(SHAPE, np.float32, [(ix, None)]), "r": None})
    assert out["w"].pieces[0][1].tobytes() == np.ascontiguousarray(full()[ix]).tobytes()
    assert out["r"].tobytes() == np.arange(10, dtype=np.int64).tobytes()


def shutdown(mode: str) -> int:
    if mode == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        import jax

        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
