"""The job's manifest at a tiered restore: what every host learns of it, and from whom.

One host, the one the plan names (it holds host 0's part: host 0 itself, or its
partner's replica), reads the step's manifest through its store (size cap,
tombstone, binding and fence checked) and broadcasts it:

- a format-2 root goes as its stored bytes (``R``), without its fragments: a
  few hundred bytes per host of the job, not every shard;
- a format-1 manifest goes whole (``M``), as it always did (a replica of host
  0's part made before the peer round carried fragments, or the durable tier's
  manifest where no fast tier holds that part);
- else the sender's one-line reason why there is none (``E``), which every host raises.

After a root, each host asks the sender for the fragments holding the shards its
own target meets (:func:`ckptio.manifest.fragments_for`: for the layout it
saved, its own and those of the arrays it shares) and gets their bytes as they
are, unparsed by the sender; it checks each against the root's size and crc32c
before the restore's planning reads it (:attr:`RoutedBackend.fragments`). What a
host receives thus grows with its own part, not with the job; the sender reads
the fragments asked for, once each, and parses none. A status round then tells
every host whether every host got its fragments, so a restore fails alike
everywhere, before any host plans.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from ckptio.backends.base import join_key
from ckptio.coord.distributed import join_errors
from ckptio.engine import gather_or_cancel, run_sync
from ckptio.errors import CheckpointNotFoundError, IntegrityError
from ckptio.manifest import MANIFEST_NAME, FragmentRef, Manifest
from ckptio.manifest.lazy import fragments_for
from ckptio.restoring.planner import select
from ckptio.store import CheckpointStore, check_binding
from ckptio.system.checksum import crc32c
from ckptio.tiers.group import PeerGroup
from ckptio.tiers.peer import OBJECT_NAME, RoutedBackend
from ckptio.tiers.policy import RestorePlan

__all__ = ["HostTiers", "manifest_for", "manifest_to_send", "stored_root"]

log = logging.getLogger("ckptio.tiers")

StoreFor = Callable[[int], CheckpointStore]


@dataclasses.dataclass(frozen=True)
class HostTiers:
    """One host's tiers at a restore: its stores, and the group it agrees with the other hosts in."""

    group: PeerGroup
    fast: CheckpointStore
    replica: CheckpointStore
    durable: CheckpointStore | None

    @property
    def rank(self) -> int:
        return self.group.rank


#: Fragments the sender reads at a time (each a few KiB to a few hundred).
_READS = 32


def manifest_for(t: HostTiers, plan: RestorePlan, holding_store: StoreFor, target: Any,
                 routed: RoutedBackend) -> Manifest:
    """Collective: the step's manifest on every host (``t``: this host's tiers),
    broadcast by the host the plan names, else the durable tier's; a format-2 root comes with the
    fragments this host's ``target`` needs put into ``routed`` (see the module's docstring)."""
    step_dir = str(plan.step)
    if plan.manifest_from is None:  # every host reads the durable tier: its root and the fragments it needs
        assert t.durable is not None
        root = run_sync(t.durable.read_manifest(step_dir, shards=False))
        if not root.complete:
            _durable_fragments(t.durable, root, step_dir, target, routed)
        return root
    data = None
    if t.rank == plan.manifest_from:
        try:
            data = _payload(t, plan, holding_store)
        except Exception as e:  # noqa: BLE001 -- every host raises it below
            log.error("step %d: cannot read the manifest to broadcast: %r", plan.step, e)
            data = f"Estep {plan.step}: host {t.rank} cannot read the job's manifest: {type(e).__name__}: {e}".encode()
    data = t.group.broadcast_bytes(data, plan.manifest_from)
    if data[:1] not in (b"M", b"R"):
        raise CheckpointNotFoundError(data[1:].decode(errors="replace"))
    where = f"{t.fast.url}/{step_dir} (host {plan.manifest_from})"
    m = Manifest.from_json(data[1:], where)
    if data[:1] == b"R":
        check_binding(m, step_dir, where)  # the same on every host: all raise alike, before the round
        _fragment_round(t, plan, m, holding_store, target, routed)
    return m


def _payload(t: HostTiers, plan: RestorePlan, holding_store: StoreFor) -> bytes:
    """What the sender broadcasts: ``M`` and a whole manifest, or ``R`` and a format-2 root's stored bytes."""
    m = manifest_to_send(t, plan, holding_store)
    if m.complete:
        return b"M" + m.to_json()
    return b"R" + run_sync(stored_root(holding_store(0), str(plan.step), m))


async def stored_root(store: CheckpointStore, step_dir: str, root: Manifest) -> bytes:
    """The stored bytes of ``root``, the format-2 root of ``step_dir`` that ``store`` read and checked (size
    cap, tombstone, binding, fence): what goes to another host as it is. CheckpointNotFoundError if the
    step's manifest is not that one any more."""
    raw = await store.io.read(join_key(step_dir, MANIFEST_NAME))
    again = Manifest.from_json(raw, f"{store.where(step_dir)}/{MANIFEST_NAME}")
    if (again.checkpoint_id, again.fence) != (root.checkpoint_id, root.fence):  # replaced since it was checked
        raise CheckpointNotFoundError(f"{store.where(step_dir)}: its manifest changed while it was read")
    return raw


def manifest_to_send(t: HostTiers, plan: RestorePlan, holding_store: StoreFor) -> Manifest:
    """The manifest the sender broadcasts: its copy of host 0's part (host 0's own, or its partner's replica),
    which holds the job's manifest (a format-2 root without its fragments); where no fast tier holds that
    part (host 0 and its partner lost), the durable tier's, under the fast tiers' keys (other hosts' fast
    tiers hold only their own part, #33)."""
    step_dir = str(plan.step)
    if t.rank in plan.holders(0):
        return run_sync(holding_store(0).read_manifest(step_dir, shards=False))
    if t.durable is None or not plan.in_durable:
        raise CheckpointNotFoundError(f"step {plan.step}: host 0's part (the job's manifest) is in no fast tier, and "
                                      "the durable tier does not hold the step")
    there = run_sync(t.durable.read_manifest(step_dir))
    if there.checkpoint_id != plan.checkpoint_id:
        raise CheckpointNotFoundError(f"step {plan.step}: the durable tier holds checkpoint {there.checkpoint_id}, "
                                      f"the fast tiers {plan.checkpoint_id}, and host 0's part is in no fast tier")
    return dataclasses.replace(there, objects=[fast_key(k, step_dir, t.fast, there.num_hosts) for k in there.objects])


def fast_key(key: str, step_dir: str, fast: CheckpointStore, num_hosts: int) -> str:
    """The key a durable copy's object ``key`` had in the fast tiers: the fast tier's naming of its save id,
    host and number (a durable copy keeps them in its key's last component; every byte read is checked)."""
    m = OBJECT_NAME.fullmatch(key.rpartition("/")[2])
    if m is None:
        raise IntegrityError(f"{step_dir}: durable object {key!r} is not named as a save names its objects", key=key)
    return fast.naming.object_key(step_dir, m["sid"], int(m["host"]), num_hosts, int(m["n"]))


def _fragment_round(t: HostTiers, plan: RestorePlan, root: Manifest, holding_store: StoreFor, target: Any,
                    routed: RoutedBackend) -> None:
    """Collective: each host asks the sender for the fragments its target meets, gets them as stored,
    checks them, and keeps them in ``routed``; raises on every host if any host's failed."""
    src, refs, step_dir = plan.manifest_from, root.fragments or [], str(plan.step)
    try:
        numbers = fragments_for(root, lambda: select(root, target, step_dir).boxes(root))
    except Exception:  # noqa: BLE001 -- the restore's planning raises it again, on this host's turn
        numbers = []
    asks = t.group.exchange({src: [memoryview(json.dumps(numbers).encode())]} if numbers else {})
    sends: dict[int, list[memoryview]] = {}
    error: str | None = None
    if t.rank == src:
        sends, error = _fragments_asked(holding_store(0), refs, asks)
    got = t.group.exchange(sends, {src: [refs[f].size for f in numbers]} if numbers else {})
    if numbers and error is None:
        error = _keep(got.get(src, bytearray()), [refs[f] for f in numbers], routed)
    errors = t.group.gather(f"host {t.rank}: {error}" if error else None)
    verdict = t.group.broadcast(join_errors([e for e in errors if e]) if errors is not None else None)
    if verdict:
        raise CheckpointNotFoundError(f"step {plan.step}: the manifest's fragments did not reach every host: {verdict}")


def _durable_fragments(durable: CheckpointStore, root: Manifest, step_dir: str, target: Any,
                       routed: RoutedBackend) -> None:
    """Put the fragments of the durable tier's format-2 ``root`` that this host's ``target`` meets into
    ``routed`` (read once each, checked against the root): no host loads the job's shards. One that
    cannot be read or does not match is left out (logged): this host's planning then fails on it, and
    every host learns that in the restore's status round."""
    try:
        numbers = fragments_for(root, lambda: select(root, target, step_dir).boxes(root))
    except Exception:  # noqa: BLE001 -- the restore's planning raises it again
        return
    refs = [(root.fragments or [])[f] for f in numbers]
    sends, error = _fragments_asked(durable, root.fragments or [], {0: bytearray(json.dumps(numbers).encode())})
    error = error or _keep(bytearray(b"".join(sends.get(0, []))), refs, routed)
    if error is not None:  # not raised here: planning fails on the missing fragment, inside the status rounds
        log.error("step %s: the durable tier's fragments: %s", step_dir, error)


def _fragments_asked(store: CheckpointStore, refs: list[FragmentRef], asks: dict[int, bytearray]
                     ) -> tuple[dict[int, list[memoryview]], str | None]:
    """The sender's side: every asker's fragments, read once each (zeros, and why, where they cannot be:
    each asker still gets the bytes it waits for)."""
    wanted: dict[int, list[int]] = {}
    error = None
    for needer, data in asks.items():
        numbers = json.loads(data)
        if not (isinstance(numbers, list) and all(isinstance(f, int) and 0 <= f < len(refs) for f in numbers)):
            error = f"host {needer} asked for fragments the root does not have"
            numbers = [f for f in numbers if isinstance(f, int) and 0 <= f < len(refs)] if isinstance(numbers, list) else []
        wanted[needer] = numbers
    read: dict[int, bytes] = {}

    async def one(f: int) -> None:
        read[f] = await store.io.read(refs[f].key)

    try:
        run_sync(gather_or_cancel((one(f) for f in sorted({f for fs in wanted.values() for f in fs})), limit=_READS))
    except Exception as e:  # noqa: BLE001 -- carried into the status round
        error = f"cannot read its fragments: {type(e).__name__}: {e}"
    zeros = {f: bytes(refs[f].size) for fs in wanted.values() for f in fs if f not in read}
    return {n: [memoryview(read[f] if f in read else zeros[f]) for f in fs] for n, fs in wanted.items()}, error


def _keep(data: bytearray, refs: list[FragmentRef], routed: RoutedBackend) -> str | None:
    """Put each fragment of ``data`` (``refs``' bytes back to back) into ``routed``; why not, if one is not
    the fragment the root records."""
    at = 0
    for ref in refs:
        piece = bytes(data[at : at + ref.size])
        at += ref.size
        if len(piece) != ref.size or crc32c(piece) != ref.crc32c:
            return f"fragment {ref.key!r} as received does not match the checksum the root records"
        routed.fragments[ref.key] = piece
    return None
