"""The durable round on format 2: each host copies its own fragment, host 0 commits a small root.

A fast-tier step saved by many hosts is a format-2 checkpoint on host 0 (its root and every host's
fragment, :mod:`ckptio.saving.carried_fragments`); each other host holds only its own objects and its commit record.
The durable copy keeps that shape, so that host 0 parses no other host's shards:

1. host 0 reads each fragment's stored bytes once and sends it to the host that wrote it (an
   exchange: O(its own fragment) per host, O(H) fragments sent by host 0, none parsed there);
2. each host checks its fragment against the root's size and crc32c and writes it to the durable
   tier beside its objects, under the same key. Where the durable naming gives its objects other
   keys than the fast tier's (a hashed naming: the key depends on the object's index in the
   checkpoint, which the host's record carries, :func:`ckptio.manage.copying.rekey_one`), the host first
   rewrites its fragment's object list to those keys and re-seals it: the fragment names what is
   in the durable tier, whatever its naming. It reports the reference (key, size, crc32c) of what it wrote;
3. host 0 commits the root it holds, with those references and a fence of the durable commit's own,
   last, after every host's copy succeeded.

What a deleter sees is a plain format-2 checkpoint: the root names every fragment, each fragment
its objects, so retention, gc and the step sweep own every key of it as they own a native save's.
Until the root stands, each host's lease covers the save id its objects and its fragment carry.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ckptio.engine import gather_or_cancel, run_sync
from ckptio.manage.copying import rekey_one
from ckptio.manifest import FragmentRef, Manifest
from ckptio.manifest.codec.sections import parse_head, with_objects
from ckptio.manifest.fragments import FRAGMENT_PREFIX, fragment_ref
from ckptio.manifest.names import new_id
from ckptio.manifest.sealing import seal, unseal
from ckptio.store import CheckpointStore
from ckptio.store.parts import PartRecord
from ckptio.system import jsonio as _json
from ckptio.system.checksum import crc32c
from ckptio.tiers.group import PeerGroup

__all__ = ["DurableFragment", "durable_fragment", "durable_root", "exchange_fragments", "fragment_save_id"]

#: Fragments host 0 reads at a time.
_READS = 32


@dataclasses.dataclass(frozen=True)
class DurableFragment:
    """What a host writes to the durable tier for its fragment, and the reference host 0's root gets."""

    data: bytes
    ref: FragmentRef


def exchange_fragments(group: PeerGroup, own: CheckpointStore, root: Manifest | None) -> bytes:
    """Collective: host 0 (with the fast tier's ``root``) sends each host its fragment as stored; returns
    this host's message: a JSON line (``{"ref": ...}``, ``{"ref": null}`` for a host without one, or
    ``{"error": ...}``) followed by the fragment's bytes. Raises nothing: every host takes part."""
    sends: dict[int, list[memoryview]] = {}
    if group.rank == 0:
        sends = _fragment_sends(own, root, group.size)
    got = group.exchange(sends)
    return bytes(got.get(0, b""))


def _fragment_sends(own: CheckpointStore, root: Manifest | None, size: int) -> dict[int, list[memoryview]]:
    """Host 0's messages: each host's fragment, read once, unparsed (an error line where it cannot be)."""
    refs = (root.fragments or []) if root is not None else []
    by_host = {ref.host: ref for ref in refs}
    read: dict[int, bytes] = {}
    error: str | None = None

    async def one(ref: FragmentRef) -> None:
        read[ref.host] = await own.io.read(ref.key)

    try:
        if root is None:
            raise RuntimeError("host 0 holds no root of the step")
        run_sync(gather_or_cancel((one(ref) for ref in refs), limit=_READS))
    except Exception as e:  # noqa: BLE001 -- every host learns it from its own message
        error = f"host 0 cannot read the fragments: {type(e).__name__}: {e}"
    out: dict[int, list[memoryview]] = {}
    for host in range(size):
        ref = by_host.get(host)
        if error is not None:
            head = {"error": error}
        else:
            head = {"ref": dataclasses.asdict(ref) if ref is not None else None}
        body = read.get(host, b"") if error is None else b""
        out[host] = [memoryview(json.dumps(head).encode() + b"\n"), memoryview(body)]
    return out


def durable_fragment(message: bytes, rank: int, part: PartRecord, step_dir: str,
                     durable: CheckpointStore) -> DurableFragment | None:
    """This host's fragment as the durable tier gets it, from host 0's ``message``: checked against the
    root's reference, its object list renamed to the durable tier's keys where they differ. None: the
    host wrote no fragment. Raises (one line naming the fault) on anything else."""
    line, _, data = message.partition(b"\n")
    try:
        head = json.loads(line)
    except ValueError:
        raise RuntimeError(f"host 0 sent host {rank} no fragment message") from None
    if not isinstance(head, dict):
        raise RuntimeError(f"host 0 sent host {rank} no fragment message")
    if "error" in head:
        raise RuntimeError(str(head["error"]))
    if head.get("ref") is None:
        if part.objects:
            raise RuntimeError(f"host {rank} holds {len(part.objects)} objects but the root names no fragment of it")
        return None
    ref = FragmentRef(**head["ref"])
    if ref.host != rank or len(data) != ref.size or crc32c(data) != ref.crc32c:
        raise RuntimeError(f"fragment {ref.key!r} as host {rank} received it does not match the root's reference")
    head = parse_head(data, ref.head_size, ref.head_crc32c, ref.key, ref.key) if ref.head_size is not None else None
    doc = _json.loads(unseal(data, ref.key)) if head is None else None  # version 3: sealed JSON
    if (head.objects if head is not None else doc.get("objects")) != part.objects:  # type: ignore[union-attr]
        raise RuntimeError(f"fragment {ref.key!r} does not name the objects host {rank}'s commit record does")
    keys = [rekey_one(k, int(i), step_dir, durable) for k, i in zip(part.objects, part.extra["indices"], strict=True)]
    if keys == part.objects:  # a flat naming: the fragment goes as it is
        return DurableFragment(data, ref)
    if head is not None:  # a new head naming the durable keys; the sections as they are
        out = with_objects(data, head, keys, ref.key)
    else:
        assert doc is not None
        out = seal({**doc, "objects": keys})
    return DurableFragment(out, fragment_ref(ref.key, out, ref.host))


def fragment_save_id(ref: FragmentRef) -> str:
    """The save id a fragment's key carries (``<step>/ckptio.fragment.<save id>``): what a lease covers."""
    return ref.key.rpartition("/")[2].removeprefix(FRAGMENT_PREFIX)


def durable_root(stored: bytes, sent: list[Any], where: str) -> tuple[Manifest, bytes]:
    """Host 0: the durable tier's root from the fast tier's ``stored`` root bytes and every host's reference
    of the fragment it wrote (``sent[host]``: a :class:`FragmentRef` as a dict, or None), under a fresh fence.
    RuntimeError naming the host if one is not the fragment the root names for it."""
    doc = _json.loads(unseal(stored, where))
    refs = []
    for ref in doc["fragments"]:
        host = ref["host"]
        got = sent[host] if 0 <= host < len(sent) else None
        if not isinstance(got, dict) or got.get("key") != ref["key"] or got.get("host") != host \
                or type(got.get("size")) is not int or type(got.get("crc32c")) is not int:
            raise RuntimeError(f"{where}: host {host} reported no copy of its fragment {ref['key']!r}")
        # A version-4 fragment renamed for the durable tier has a head of another length and crc32c.
        heads = {k: got[k] for k in ("head_size", "head_crc32c") if got.get(k) is not None}
        if ("head_size" in ref) != bool(heads):
            raise RuntimeError(f"{where}: host {host} reported a copy of its fragment {ref['key']!r} of another version")
        refs.append({**ref, "size": got["size"], "crc32c": got["crc32c"], **heads})
    doc["fragments"] = refs
    doc["fence"] = new_id()  # the durable commit's own, as a format-1 copy gets (ckptio.store.commit)
    data = seal(doc)
    return Manifest.from_json(data, where), data
