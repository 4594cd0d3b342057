"""The tiers scale bench's replication part: host 0's side of a durable round and of a peer round.

After the save part, host 0's fast tier holds the step (``bench.tiers_scale``). Then, each in a fresh
process (its time and peak RSS its own):

* **durable round** -- host 0 runs the tiers' real ``durable_round`` into a durable tier on the same disk,
  the other hosts played by a :class:`~bench.tiers_scale.SimGroup`: their gathers echo host 0's, and a
  format-2 round's reports name the fragment each wrote. What they leave in the durable tier (their
  objects, as sparse files; their fragments) is put there before the round, untimed. Object bytes are
  not copied (sparse files of the sizes the extents need: the bench measures the coordination and the
  manifest, not the disk): ``copy_keys`` is replaced by that. Reported: the round's wall and CPU time,
  peak RSS, what host 0 receives and what it sends to one other host, and the durable manifest's size.
* **peer round's head** -- what host 0 prepares and sends its partner before the objects: its part and
  the job's manifest (a whole one, or a format-2 root and its fragments as stored), with the time and
  RSS of preparing it (reading included).

The same bench drives an older tree (``PYTHONPATH``): only names both trees have are used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

from ckptio.bench.simhost import rss_mb
from ckptio.bench.tiers_sim import NEWEST, SimGroup, objects_of

__all__ = ["durable_side", "peer_side", "prepare_durable"]


class _DurableSim(SimGroup):
    """Host 0 of a durable round; every other host's contribution to a gather echoes host 0's, and its
    report of a format-2 copy names the fragment it wrote (``refs[host]``)."""

    def __init__(self, size: int, refs: dict[int, Any]) -> None:
        super().__init__(0, size, [])
        self.refs = refs

    def _everyone(self, obj: Any) -> list[Any]:
        out = []
        for r in range(self.size):
            theirs = obj
            if r and isinstance(obj, dict) and "fragment" in obj:
                theirs = {**obj, "fragment": self.refs.get(r)}
            data = json.dumps(theirs)
            if r:
                self.received += len(data)
            out.append(json.loads(data))
        return out


def prepare_durable(root: str, records_path: str, hosts: int) -> None:
    """What the other hosts' rounds leave in the durable tier (``root/durable``): their objects (sparse) and
    their fragments (as stored: a flat naming keeps their keys)."""
    durable = os.path.join(root, "durable")
    fast0 = os.path.join(root, "fast0")
    with open(records_path) as f:  # one pass: each record is one host's line
        for r, line in enumerate(f):
            if 0 < r < hosts:
                objects_of(durable, json.loads(line))
    step = os.path.join(fast0, str(NEWEST))
    os.makedirs(os.path.join(durable, str(NEWEST)), exist_ok=True)
    for name in os.listdir(step):
        if name.startswith("ckptio.fragment.") and not name.endswith(f"{0:012x}"):
            shutil.copyfile(os.path.join(step, name), os.path.join(durable, str(NEWEST), name))


def durable_side(root: str, hosts: int, out: Any) -> None:
    """Host 0's durable round of step NEWEST (see the module's docstring)."""
    import ckptio.tiers.durable as durable_mod
    from ckptio.engine import run_sync
    from ckptio.manage.copying import CopyStats
    from ckptio.store import CheckpointStore
    from ckptio.tiers import TierPolicy

    fast = CheckpointStore(os.path.join(root, "fast0"), host_local=True)
    durable = CheckpointStore(os.path.join(root, "durable"))

    async def sparse_copy(src: Any, dst: Any, objects: Any, **_: Any) -> Any:
        stats = CopyStats()
        for _key, dst_key, extents in objects:
            path = os.path.join(dst.url.removeprefix("file://"), dst_key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(max((e[0] + e[1] for e in extents), default=0))
            stats.written += 1
        return stats

    durable_mod.copy_keys = sparse_copy
    root_m = run_sync(fast.read_manifest(str(NEWEST), shards=False))
    refs = {f.host: dataclasses.asdict(f) for f in root_m.fragments or []}
    del root_m
    sim = _DurableSim(hosts, refs)
    c0, t0 = time.process_time(), time.perf_counter()
    durable_mod.durable_round(sim, fast, durable, NEWEST, TierPolicy())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    step = os.path.join(root, "durable", str(NEWEST))
    out.put({"wall_s": wall, "cpu_s": cpu, "rss_mb": rss_mb(), "received": sim.received,
             "to_host": sum(len(b) for b in sim.broadcasts), "sent": sim.sent,
             "manifest_bytes": os.path.getsize(os.path.join(step, "ckptio.manifest.json")),
             "format": 2 if not run_sync(durable.read_manifest(str(NEWEST), shards=False)).complete else 1})


def peer_side(root: str, out: Any) -> None:
    """What host 0 prepares and sends its partner before its objects, and what that costs it."""
    from ckptio.engine import run_sync
    from ckptio.store import CheckpointStore
    from ckptio.tiers import peerround

    fast = CheckpointStore(os.path.join(root, "fast0"), host_local=True)
    c0, t0 = time.process_time(), time.perf_counter()
    mine, m = peerround.own_part(fast, NEWEST, 0)
    assert m is not None
    if hasattr(peerround, "_head"):  # the root as stored, then every fragment's bytes after the objects
        head, error = peerround._head(fast, NEWEST, mine, m)
        assert error is None, error
        sent = len(json.dumps(head)) + sum(len(run_sync(fast.io.read(f.key))) for f in m.fragments or [])
    else:  # the whole manifest, once
        sent = len(json.dumps({"record": mine.to_json().decode(), "manifest": m.to_json().decode()}))
    out.put({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "rss_mb": rss_mb(),
             "sent": sent})
