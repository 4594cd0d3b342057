"""Read-once through the DCP Reader: the storage bytes a whole ``dcp.load`` job reads, with and without.

The checkpoints of :mod:`ckptio.bench.readonce` (a 32 MiB float32 matrix
saved as ``hosts`` row shards; an 8 MiB vector and a small int64 vector,
whole), loaded with ``torch.distributed.checkpoint.load`` through
``ckptio.dcp.Reader`` in ``hosts`` real processes (gloo), each reading through
a counting backend: ``dcp_replicated`` (every rank loads the vectors whole)
and ``dcp_columns`` (each rank loads the matrix as a ``Shard(1)`` DTensor: the
rows saved, restored as column blocks). Per case and mode (``plain``,
``read_once``): the job's storage bytes over the checkpoint's, the worst
peak-RSS growth of a rank over the bytes it loaded (warm and cold, as
:mod:`ckptio.bench.readonce` says), and the slowest rank's seconds.

    python -m ckptio.bench.readonce_dcp [HOSTS [cold]]

Only the Reader's public API is used by the workers, so the same scenarios measure an older
tree too (its bench lacks :func:`~ckptio.bench.readonce.summary`: copy this file and that one).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ckptio.bench.readonce import (
    COLS, ROWS, expected, launch, make_checkpoints, measured, print_rows, stored_bytes, summary, worker_main,
)

__all__ = ["dcp_columns", "dcp_replicated", "run_readonce_dcp"]


def _load(root: str, state: dict[str, Any], read_once: bool, step: int = 1) -> dict[str, Any]:
    """``dcp.load`` of ``state`` through a counting Reader: storage bytes read, and
    :func:`~ckptio.bench.readonce.measured`'s figures (peak RSS growth warm and cold, seconds)."""
    import torch.distributed.checkpoint as dcp

    from ckptio.backends import open_backend
    from ckptio.backends.wrappers import CountingBackend
    from ckptio.dcp import Reader

    reader = Reader(root, step=step, read_once=read_once)
    counting = CountingBackend(open_backend(root))
    reader._options = dataclasses.replace(reader._options, backend=counting)  # count what it reads
    _, stats = measured(lambda: dcp.load(state, storage_reader=reader))
    return {"read": counting.bytes_read, **stats}


def dcp_replicated(root: str, read_once: bool) -> dict[str, Any]:
    """Every rank loads the replicated vectors whole (checked bit-exact)."""
    import torch

    full = expected()
    state = {n: torch.empty(full[n].shape, dtype=getattr(torch, str(full[n].dtype))) for n in ("emb", "bias")}
    stats = _load(root, state, read_once)
    for n in ("emb", "bias"):
        assert state[n].numpy().tobytes() == full[n].tobytes(), n
    return {**stats, "restored": sum(full[n].nbytes for n in ("emb", "bias"))}


def dcp_columns(root: str, read_once: bool, step: int = 1) -> dict[str, Any]:
    """Each rank loads its column block of the row-sharded matrix as a Shard(1) DTensor (bit-exact)."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,))
    cols = COLS // world
    local = torch.zeros(ROWS, cols, dtype=torch.float32)
    w = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1))
    stats = _load(root, {"w": w}, read_once, step)
    want = np.ascontiguousarray(expected()["w"][:, rank * cols:(rank + 1) * cols])
    assert w.to_local().numpy().tobytes() == want.tobytes()
    return {**stats, "restored": want.nbytes}


SCENARIOS = {"dcp_replicated": ("replicated", dcp_replicated), "dcp_columns": ("columns", dcp_columns)}


def run_readonce_dcp(hosts: int = 8, root: str | None = None, cold: bool = False) -> list[dict[str, Any]]:
    """Per case and mode: job storage bytes read, that over the checkpoint's bytes, worst RSS growth
    (``cold``: no rank warms up first)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        for case, (saved, _fn) in SCENARIOS.items():
            ckpt = os.path.join(tmp, case)
            make_checkpoints(ckpt, hosts, saved)
            stored = stored_bytes(ckpt)
            for mode in ("plain", "read_once"):
                reports = launch(os.path.abspath(__file__), hosts, [case, ckpt] + (["plain"] if mode == "plain" else [])
                                 + (["cold"] if cold else []),
                                 Path(tmp, f"{case}-{mode}"))
                rows.append(summary(case, mode, stored, reports))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 3:  # a process of a job (OUT_DIR SCENARIO ROOT ...)
        sys.exit(worker_main(sys.argv[1:], {k: fn for k, (_s, fn) in SCENARIOS.items()}, default_group=True))
    print_rows(run_readonce_dcp(int(sys.argv[1]) if len(sys.argv) > 1 else 8, cold="cold" in sys.argv[2:]))
