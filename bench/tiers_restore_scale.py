"""The manifest at a tiered restore of a job of thousands of hosts (a part of ``--tiers-scale``).

After the save part of :mod:`bench.tiers_scale` committed one step in host 0's fast tier, every host
restores it in the layout it saved: the tiers' restore has the host the plan names (host 0) broadcast the
step's manifest, and each host loads the shards its target meets (``ckptio.tiers.rootcast`` where the tree
has it: the root, then the fragments each host asks host 0 for; before it, the whole manifest to every
host). Measured on host 0 and on host 1, each in a fresh process: bytes received and sent, CPU and wall
seconds of getting the manifest and loading its shards for the host's own target, peak RSS, and how many
shards of one array the host then holds. The other hosts' asks are taken to be what host 1's was for its
own rank (checked on host 1).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ckptio.bench.simhost import rss_mb
from ckptio.bench.tiers_sim import COLS, NEWEST, SimGroup

__all__ = ["restore_side"]

#: Rows of every array per host (bench.scale's layout: host r holds rows [8r, 8r + 8)).
ROWS = 8


class RestoreSim(SimGroup):
    """:class:`SimGroup` for the restore's fragment round: on host 0, every other host asks for its own
    fragment; elsewhere, an ask to host 0 is counted as sent and host 0's reply is replayed."""

    def exchange(self, sends: dict[int, list[memoryview]], sizes: dict[int, list[int]] | None = None
                 ) -> dict[int, bytearray]:
        if sizes is not None:
            return super().exchange(sends, sizes)
        if self.rank != 0:
            asked = {d: json.loads(b"".join(bytes(b) for b in bufs)) for d, bufs in sends.items()}
            assert asked == {0: [self.rank]}, asked  # what host 0's run takes every host to ask
            self.sent += sum(len(b) for bufs in sends.values() for b in bufs)
            return {}
        got = {r: bytearray(json.dumps([r]).encode()) for r in range(1, self.size)}
        self.received += sum(len(v) for v in got.values())
        if sends.get(0):
            got[0] = bytearray(b"".join(bytes(b) for b in sends[0]))
        return got


def _target(items: dict[str, Any], rank: int) -> dict[str, Any]:
    """Host ``rank``'s own rows of every array (``items``: name -> [shape, dtype]), as it saved them (no
    buffers: the plan allocates)."""
    import importlib

    from ckptio.state.leaves import Sharded

    importlib.import_module("ml_dtypes")  # bfloat16 by name
    tree: dict[str, Any] = {}
    for name, (shape, dtype) in items.items():
        *path, leaf = name.split("/")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = Sharded(tuple(shape), dtype, [((slice(rank * ROWS, (rank + 1) * ROWS), slice(0, COLS)), None)])
    return tree


def restore_side(root: str, hosts: int, rank: int, replay_path: str, out: Any) -> None:
    """Host ``rank``'s side of the restore's manifest (see the module's docstring)."""
    import ckptio.tiers.restore as tr
    from ckptio.engine import run_sync
    from ckptio.manifest import ArrayItem
    from ckptio.restoring.planner import select
    from ckptio.store import CheckpointStore
    from ckptio.tiers.peer import RoutedBackend
    from ckptio.tiers.policy import RestorePlan

    step_dir = str(NEWEST)
    replay: list[bytes] = []
    fast = CheckpointStore(os.path.join(root, f"fast{rank}"), host_local=True)
    if rank == 0:  # the step's id and arrays, known to every host before its restore (not timed)
        root_m = run_sync(fast.read_manifest(step_dir, shards=False))
        cid = root_m.checkpoint_id
        items = {n: [list(it.shape), it.dtype.name] for n, it in root_m.items.items() if isinstance(it, ArrayItem)}
        del root_m
    else:
        with open(replay_path) as f:
            saved = json.load(f)
        cid, items, replay = saved["cid"], saved["items"], [bytes.fromhex(x) for x in saved["replay"]]
    target = _target(items, rank)
    sim = RestoreSim(rank, hosts, [None] * hosts, replay)
    plan = RestorePlan(NEWEST, cid, hosts, 0, False, hosts, replica_offset=1)
    routed = RoutedBackend(f"tiers://{fast.url}", {})
    store = CheckpointStore(routed.url, backend=routed, host_local=True)
    fresh = CheckpointStore(fast.url, host_local=True)  # nothing cached from the read above
    t = tr.HostTiers(sim, fresh, fresh, None)  # type: ignore[arg-type]
    rss0 = rss_mb()
    c0, t0 = time.process_time(), time.perf_counter()
    holding = lambda w: fresh  # noqa: E731 -- host 0's own fast tier holds host 0's part
    if hasattr(tr, "manifest_for"):  # this tree: the root, then the fragments this host's target needs
        m = tr.manifest_for(t, plan, holding, target, routed)
    else:  # the tree before: the whole manifest, broadcast
        m = tr._manifest(t, plan, holding)
    loaded = run_sync(store.load_fragments(step_dir, m, lambda: select(m, target, step_dir).boxes(m)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    first = next(n for n, it in loaded.items.items() if isinstance(it, ArrayItem))
    if rank == 0:
        with open(replay_path, "w") as f:
            json.dump({"cid": cid, "items": items, "replay": [b.hex() for b in sim.broadcasts]}, f)
    out.put({"cpu_s": cpu, "wall_s": wall, "received": sim.received, "sent": sim.sent, "rss_mb": rss_mb(),
             "rss0_mb": rss0, "shards_at_hand": len(loaded.items[first].shards), "objects": len(loaded.objects)})
