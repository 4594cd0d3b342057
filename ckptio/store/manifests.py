"""Reading a step's manifest: the size cap, the tombstone and fence checks, the binding, the cache.

A manifest counts (:meth:`Manifests.read_root`) only if it is no larger than
``MAX_MANIFEST_BYTES`` (refused before a byte is read), no tombstone stands
beside it, it validates, it is bound to its step directory
(:func:`check_binding`) and its fence, if it has one, says "commit"
(:mod:`ckptio.store.fence`). Deleters and the gc read it unchecked
(:meth:`Manifests.read_unchecked`): they must see the manifest of a damaged,
unconfirmed or revoked commit too.
"""

from __future__ import annotations

from collections.abc import Collection

from ckptio.backends.base import ByteRange, join_key
from ckptio.engine import gather_or_cancel
from ckptio.errors import CheckpointNotFoundError, IntegrityError, ManifestError, UnconfirmedCommitError
from ckptio.manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, TOMBSTONE_NAME, Fetch, Manifest, Wanted, unseal, with_fragments,
    with_shards_meeting,
)
from ckptio.manifest.lazy import FetchRanges
from ckptio.manifest.refs import check_foreign_keys
from ckptio.store.context import StoreContext
from ckptio.store.fence import COMMIT, REVOKED, Fences

__all__ = ["Manifests", "check_binding"]

#: The cache is dropped whole past this many manifests (a manager keeps a handful of steps).
_CACHE_SIZE = 64
#: Fragment reads (or ranges of them) made in one storage call: enough to amortise a call's cost
#: (a thread hop, retry and deadline wrappers: ~0.2 ms), few enough to keep many calls in flight.
READS_PER_CALL = 32


def check_binding(manifest: Manifest, step_dir: str, where: str) -> None:
    """ManifestError unless ``manifest`` belongs in ``step_dir``: the step it records, and objects in that step.

    A manifest copied or moved into another step directory would otherwise
    restore the other step's data under this step's name (and a deletion of
    the copy would delete the original's objects).
    """
    if step_dir:
        if manifest.step != int(step_dir):
            raise ManifestError(f"{where}: the manifest is for step {manifest.step}, not {step_dir} "
                                "(copied or moved from elsewhere?)")
    check_foreign_keys(manifest, step_dir, where)  # only a format-9 manifest's bases lie elsewhere


class Manifests:
    """The manifests of one store, validated, fence-checked and cached by (step, size, mtime)."""

    def __init__(self, ctx: StoreContext, fences: Fences) -> None:
        self.ctx = ctx
        self.fences = fences
        self._cache: dict[tuple[str, int, float], Manifest] = {}

    async def read_manifest(self, step_dir: str, *, shards: bool = True) -> Manifest:
        """The validated manifest of a committed checkpoint.

        CheckpointNotFoundError if there is none (or it is being deleted, or its commit does
        not stand: UnconfirmedCommitError); ManifestError / IntegrityError naming the step if
        it is damaged, too large, or not bound to ``step_dir`` (copied or moved from elsewhere).
        A format-2 checkpoint comes with every fragment loaded, or with ``shards=False`` as its
        root alone (see :meth:`load_fragments`).
        """
        return await self.with_shards(step_dir, await self.read_root(step_dir), shards)

    async def with_shards(self, step_dir: str, root: Manifest, shards: bool) -> Manifest:
        """``root`` with every fragment of a format-2 checkpoint loaded when ``shards``."""
        return await self.load_fragments(step_dir, root, None) if shards else root

    async def load_fragments(self, step_dir: str, root: Manifest, wanted: Wanted) -> Manifest:
        """``root`` with the shards that meet ``wanted`` (item -> boxes, or a callable making them;
        None: all) at hand: a format-2 root's fragments holding them read, any other manifest as is."""
        where = f"{self.ctx.where(step_dir)}/{MANIFEST_NAME}"
        return await with_shards_meeting(root, wanted, self._fetcher(root, where), step_dir, where,
                                         fetch_ranges=self._ranger(root, where))

    async def load_fragment_numbers(self, step_dir: str, root: Manifest, numbers: list[int],
                                    names: Collection[str] | None = None) -> Manifest:
        """A format-2 ``root`` with the shards of its fragments ``numbers`` at hand (only items
        ``names``; None: all): what a host reads to send the shards it is responsible for."""
        where = f"{self.ctx.where(step_dir)}/{MANIFEST_NAME}"
        return await with_fragments(root, numbers, self._fetcher(root, where), step_dir, where, names=names,
                                    fetch_ranges=self._ranger(root, where))

    def _fetcher(self, root: Manifest, where: str) -> Fetch:
        refs = root.fragments or []

        async def fetch(numbers: list[int]) -> dict[int, bytes]:
            # The root records each fragment's size: one read of those bytes, no stat before it.
            got = await self._read_ranges([(refs[i].key, 0, refs[i].size) for i in numbers], where)
            return dict(zip(numbers, got))  # a new one per batch: the caller drops each once decoded

        return fetch

    def _ranger(self, root: Manifest, where: str) -> FetchRanges:
        refs = root.fragments or []

        async def fetch_ranges(ranges: list[tuple[int, int, int]]) -> list[bytes]:
            return await self._read_ranges([(refs[f].key, start, end) for f, start, end in ranges], where)

        return fetch_ranges

    async def _read_ranges(self, ranges: list[tuple[str, int, int]], where: str) -> list[bytes]:
        """Bytes ``[start, end)`` of each fragment ``(key, start, end)``, in order, with
        :meth:`_read_range`'s errors. Where the backend batches reads, ``READS_PER_CALL`` at a time
        in one :meth:`~ckptio.backends.base.Backend.read_many` (a few KiB each: a call apiece
        would cost more than the bytes); else one by one, as many at once as before."""
        out: list[bytes] = [b""] * len(ranges)
        per = READS_PER_CALL if self.ctx.io.batches_reads else 1  # else each under its own retry and deadline

        async def group(at: int) -> None:
            part = ranges[at : at + per]
            if len(part) == 1 or any(end <= start for _k, start, end in part):
                for k, (key, start, end) in enumerate(part, at):  # an empty range is a stat
                    out[k] = await self._read_range(key, start, end, where)
                return
            bufs = [bytearray(end - start) for _k, start, end in part]
            try:
                await self.ctx.io.read_many([(key, ByteRange(start, end), [memoryview(b)])
                                             for (key, start, end), b in zip(part, bufs)])
            except (FileNotFoundError, ValueError):  # which one? one by one names it, as a lone read does
                for k, (key, start, end) in enumerate(part, at):
                    out[k] = await self._read_range(key, start, end, where)
                return
            out[at : at + len(part)] = bufs  # no copy: each buffer is this read's alone

        await gather_or_cancel((group(at) for at in range(0, len(ranges), per)),
                               limit=self.ctx.concurrency * 2)
        return out

    async def _read_range(self, key: str, start: int, end: int, where: str) -> bytes:
        """Bytes ``[start, end)`` of fragment ``key``; IntegrityError naming it if it is missing or
        shorter than the root records."""
        buf = bytearray(end - start)
        try:
            if end > start:
                await self.ctx.io.read_into(key, ByteRange(start, end), [memoryview(buf)])
            else:
                await self.ctx.io.stat(key)
        except FileNotFoundError:
            raise IntegrityError(f"{where}: fragment {key!r} is missing", key=key) from None
        except ValueError:  # the range runs past its end: not the object the root records
            raise IntegrityError(f"{where}: fragment {key!r} is shorter than the root manifest records",
                                 key=key) from None
        return bytes(buf)

    async def read_unchecked(self, step_dir: str) -> Manifest:
        """The manifest of ``step_dir`` as stored: parsed and validated, nothing else checked.

        FileNotFoundError if there is none; ManifestError / IntegrityError if it does not parse.
        What deleters read: a tombstoned, unconfirmed or revoked commit's manifest still says
        which objects are whose.
        """
        key = join_key(step_dir, MANIFEST_NAME)
        return Manifest.from_json(await self.ctx.io.read(key), f"{self.ctx.where(step_dir)}/{MANIFEST_NAME}")

    async def read_root(self, step_dir: str, *, explain: bool = True) -> Manifest:
        """The validated root manifest of ``step_dir``; ``explain=False`` skips the listing that
        tells "not committed" from "absent" in the error (a scan of steps knows the directory)."""
        where = self.ctx.where(step_dir)
        key = join_key(step_dir, MANIFEST_NAME)
        try:
            info = await self.ctx.io.stat(key)
            cached = self._cache.get((step_dir, info.size, info.mtime))
            if cached is None:
                data = await self._read_sealed(key, info.size, where)
        except FileNotFoundError:
            raise await self._not_found(step_dir, where, explain) from None
        if await self.ctx.exists(join_key(step_dir, TOMBSTONE_NAME)):
            raise CheckpointNotFoundError(f"checkpoint {where} is being deleted")
        if cached is not None:
            return cached
        manifest = Manifest.from_json(data, f"{where}/{MANIFEST_NAME}")
        check_binding(manifest, step_dir, f"{where}/{MANIFEST_NAME}")
        await self.check_fence(step_dir, manifest)
        self.remember(step_dir, info.size, info.mtime, manifest)
        return manifest

    async def _read_sealed(self, key: str, size: int, where: str) -> bytes:
        """The manifest's bytes, refused before a byte is read if too large; read twice if the first
        read does not unseal (corrupted in flight? one more read tells)."""
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}/{MANIFEST_NAME}: manifest of {size} bytes exceeds {MAX_MANIFEST_BYTES}")
        data = await self.ctx.io.read(key)
        try:
            unseal(data, f"{where}/{MANIFEST_NAME}")
        except (IntegrityError, ManifestError):
            data = await self.ctx.io.read(key)
        return data

    async def _not_found(self, step_dir: str, where: str, explain: bool) -> CheckpointNotFoundError:
        """The error for a step without a manifest: "not committed" when its directory exists."""
        if not explain:
            return CheckpointNotFoundError(f"checkpoint {where} is not committed")
        if step_dir and step_dir in await self.ctx.io.list_children(""):
            return CheckpointNotFoundError(
                f"checkpoint {where} is not committed (it has no manifest): its save did not finish "
                "or is still in flight"
            )
        return CheckpointNotFoundError(f"no checkpoint at {where}")

    async def check_fence(self, step_dir: str, manifest: Manifest) -> None:
        """UnconfirmedCommitError unless ``manifest``'s commit stands (its fence says "commit")."""
        if not manifest.fence:
            return  # written before fencing: the manifest alone commits
        outcome = await self.fences.outcome(step_dir, manifest.fence)
        if outcome == COMMIT:
            return
        why = ("its save was revoked (paused past its lease; a deleter took its objects)" if outcome == REVOKED
               else "its commit is not confirmed (in flight, or its saver died mid-commit)")
        raise UnconfirmedCommitError(f"checkpoint {self.ctx.where(step_dir)} is not committed: {why}",
                                     manifest=manifest, outcome=outcome)

    def remember(self, step_dir: str, size: int, mtime: float, manifest: Manifest) -> None:
        """Cache a manifest that counts, keyed by what a stat of it says; a root checkpoint never is
        (it may be replaced in place: ckptio.dcp overwrite)."""
        if not step_dir:
            return
        if len(self._cache) > _CACHE_SIZE:
            self._cache.clear()
        self._cache[(step_dir, size, mtime)] = manifest

    def forget(self, step_dir: str) -> None:
        """Drop the cached manifests of ``step_dir`` (it was deleted)."""
        self._cache = {k: v for k, v in self._cache.items() if k[0] != step_dir}
