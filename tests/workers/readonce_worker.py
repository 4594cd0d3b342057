"""One process of a multi-process read-once test (launched by tests/restoring/test_readonce_mp.py).

usage: readonce_worker.py OUT_DIR SCENARIO ROOT (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the env)

The bench's scenarios (ckptio.bench.readonce: ``replicated``, ``columns``) and
``faults``: a flipped byte, then a missing object, restored with read-once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ckptio.bench.readonce import COLS, ROWS, SCENARIOS, expected, worker_main


def flip_a_byte(root: str, step: int, rows_of: int, hosts: int) -> str:
    """Flip one byte of the stored ``w`` rows that host ``rows_of`` restores in ``faults``; the object's key."""
    from ckptio.engine import run_sync
    from ckptio.store import CheckpointStore

    m = run_sync(CheckpointStore(root).read_manifest(str(step)))
    shard = next(s for s in m.items["w"].shards if s.offsets[0] == rows_of * (ROWS // hosts))
    e = shard.extents[0]
    key = m.objects[e.object]
    with open(os.path.join(root, key), "r+b") as f:
        f.seek(e.offset + 100)
        b = f.read(1)
        f.seek(e.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    return key


def _failure(fn: Any) -> list[str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        return [type(e).__name__, str(e)]
    return ["", ""]


def faults(root: str, read_once: bool) -> dict[str, Any]:
    """Step 2 has a flipped byte (``flip_a_byte``, by the parent) in the rows host 1 restores;
    then rank 0 deletes step 2's data object; then the newest restorable step is restored."""
    import torch.distributed as dist

    import ckptio

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows = ROWS // world
    ix = (slice(rank * rows, (rank + 1) * rows), slice(None))
    target = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)])}
    flipped = _failure(lambda: ckptio.restore(root, 2, target, read_once=True))
    dist.barrier()
    if rank == 0:
        for name in os.listdir(os.path.join(root, "2")):
            if not name.startswith("ckptio."):
                os.remove(os.path.join(root, "2", name))
    dist.barrier()
    missing = _failure(lambda: ckptio.restore(root, 2, target, read_once=True))
    out = ckptio.restore(root, None, target, read_once=True)  # falls back to step 1 on every host
    assert out["w"].pieces[0][1].tobytes() == np.ascontiguousarray(expected()["w"][ix]).tobytes()
    return {"flipped": flipped, "missing": missing}


def dcp_replicated(root: str, read_once: bool) -> dict[str, Any]:
    """``torch.distributed.checkpoint.load`` of the replicated arrays through ckptio's DCP Reader."""
    import dataclasses

    import torch
    import torch.distributed.checkpoint as dcp

    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend
    from ckptio.dcp import Reader

    full = expected()
    state = {"emb": torch.empty(full["emb"].shape, dtype=torch.float32)}
    reader = Reader(root, step=1, read_once=read_once)
    counting = CountingBackend(open_backend(root))
    reader._options = dataclasses.replace(reader._options, backend=counting)  # count what it reads
    dcp.load(state, storage_reader=reader)
    assert state["emb"].numpy().tobytes() == full["emb"].tobytes()
    return {"read": counting.bytes_read}


def dcp_faults(root: str, read_once: bool) -> dict[str, Any]:
    """``dcp.load`` with read_once of step 2's rows as column blocks, with a flipped byte
    (``flip_a_byte``, by the parent) in the rows host 1 saved; then step 1, bit-exact."""
    from ckptio.bench.readonce_dcp import dcp_columns

    try:
        dcp_columns(root, True, step=2)
        flipped = ["", ""]
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        flipped = [type(e).__name__, str(e)]
    return {**dcp_columns(root, True), "flipped": flipped}


def manager_default(root: str, read_once: bool) -> dict[str, Any]:
    """``CheckpointManager.restore()`` with no ``read_once``: over torch.distributed it reads once."""
    import ckptio
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    full = expected()
    counting = CountingBackend(open_backend(root))
    with ckptio.CheckpointManager(root, backend=counting) as mngr:
        out = mngr.restore(1, {"emb": None, "bias": None})
    for name in ("emb", "bias"):
        assert out[name].tobytes() == full[name].tobytes(), name
    return {"read": counting.bytes_read}


def manager_columns(root: str, read_once: bool) -> dict[str, Any]:
    """``CheckpointManager.restore()`` with no ``read_once`` of rows saved, restored as column blocks."""
    import ckptio
    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cols = COLS // world
    ix = (slice(None), slice(rank * cols, (rank + 1) * cols))
    counting = CountingBackend(open_backend(root))
    with ckptio.CheckpointManager(root, backend=counting) as mngr:
        out = mngr.restore(1, {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)])})
    assert out["w"].pieces[0][1].tobytes() == np.ascontiguousarray(expected()["w"][ix]).tobytes()
    return {"read": counting.bytes_read}


def exchange(root: str, read_once: bool) -> dict[str, Any]:
    """TorchCoordinator.exchange (and exchange_into): empty and self messages, several buffers a message, read-only
    buffers, pieces cut finer than a message (the piece size made tiny), lengths known or not."""
    import ckptio.coord.exchange as ex
    from ckptio.coord.distributed import default_coordinator

    ex._PIECE = 1000  # so that messages and buffers are cut in several pieces
    coord: Any = default_coordinator()
    rank, size = coord.rank, coord.size

    def payload(src: int, dst: int, part: int) -> bytes:
        n = ((src * 7 + dst * 3 + part) % 4) * 1300  # some empty
        return bytes((src * 31 + dst * 17 + part + i) % 251 for i in range(n))

    sends = {d: [memoryview(payload(rank, d, p)) for p in range(3)] for d in range(size)}  # read-only bytes
    want = {s: b"".join(payload(s, rank, p) for p in range(3)) for s in range(size)}
    got = coord.exchange(sends)
    assert {s: bytes(b) for s, b in got.items()} == {s: w for s, w in want.items() if w}, "without sizes"
    sizes = {s: [len(payload(s, rank, p)) for p in range(3)] for s in range(size) if want[s]}
    got = coord.exchange(sends, sizes)
    assert {s: bytes(b) for s, b in got.items()} == {s: w for s, w in want.items() if w}, "with sizes"
    # Into the caller's buffers (numpy, as a restore's targets are): each source's bytes where asked.
    into = {s: [memoryview(np.zeros(n, np.uint8)) for n in sizes[s]] for s in sizes}
    coord.exchange_into(sends, sizes, into)
    assert {s: b"".join(v.tobytes() for v in views) for s, views in into.items()} == \
        {s: w for s, w in want.items() if w}, "into"
    return {"ok": True}


def exchange_faults(root: str, read_once: bool) -> dict[str, Any]:
    """Step 1 (rows saved) restored as column blocks by logical-box exchange, counted and checked
    bit-exact; then step 2, which has a flipped byte (``flip_a_byte``, by the parent)."""
    import ckptio
    from ckptio.bench.readonce import restore_counted

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cols = COLS // world
    ix = (slice(None), slice(rank * cols, (rank + 1) * cols))
    target = {"w": ckptio.Sharded((ROWS, COLS), np.float32, [(ix, None)])}
    out, stats = restore_counted(root, 1, target, "exchange")
    got = out["w"].pieces[0][1]
    assert got.tobytes() == np.ascontiguousarray(expected()["w"][ix]).tobytes()
    del out
    # Once more, warm (modules imported, gloo's buffers made): what a restore itself holds.
    again, warm = restore_counted(root, 1, target, "exchange")
    del again
    flipped = _failure(lambda: restore_counted(root, 2, target, "exchange"))
    return {**stats, "warm_rss_growth": warm["rss_growth"], "restored": got.nbytes, "flipped": flipped}


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:], {**SCENARIOS, "faults": faults, "dcp": dcp_replicated,
                                                "dcp_faults": dcp_faults, "exchange": exchange,
                                                "manager": manager_default,
                                                "manager_columns": manager_columns, "exchange_faults": exchange_faults}))
