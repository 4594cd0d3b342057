"""Format 9: a manifest's references to older steps' objects, and its shards' digests.

An incremental save (docs/incremental.md) does not write a shard whose bytes
equal the previous step's: its manifest names the object that already holds
them, under an older step. Two top-level fields say so::

    "bases":   {"<step>": "<checkpoint id>", ...},
    "digests": {"<item>": [[[offsets...], [shape...], "<sha256 hex>"], ...], ...}

``bases``: the older steps whose objects ``objects`` may name, each with the
checkpoint id committed there when the reference was made. ``digests``: the
sha256 of a shard's bytes as stored, by item and box: what the next
incremental save compares. Any key outside the manifest's own step must lie in
one of its bases, each older than the manifest's own step; nothing else about
reading changes (an extent names an object by number, wherever it lies).
"""

from __future__ import annotations

import re
from typing import Any

from ckptio.errors import ManifestError
from ckptio.manifest.formats import REFS_VERSION
from ckptio.manifest.limits import MAX_COUNT, check_dims
from ckptio.manifest.model import Box, Manifest
from ckptio.manifest.names import step_of_key

__all__ = ["check_foreign_keys", "decode_refs", "encode_refs", "referenced", "uses_refs"]

_CID = re.compile(r"[0-9a-f]{12}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_STEP = re.compile(r"0|[1-9][0-9]{0,18}")


def uses_refs(manifest: Manifest) -> bool:
    """Whether ``manifest`` needs format 9 (it references other steps, or records digests)."""
    return bool(manifest.bases) or bool(manifest.digests)


def decode_refs(doc: dict[str, Any], version: int, where: str) -> dict[str, Any]:
    """The validated ``bases`` and ``digests`` of a document (empty for one without them), as
    keyword arguments of :class:`~ckptio.manifest.model.Manifest`."""
    raw_bases, raw_digests = doc.get("bases"), doc.get("digests")
    if raw_bases is None and raw_digests is None:
        return {}
    if version < REFS_VERSION:
        raise ManifestError(f"{where}: 'bases' / 'digests' need format {REFS_VERSION}, the document says {version}")
    return {"bases": _bases(raw_bases, doc.get("step"), where), "digests": _digests(raw_digests, where)}


def _bases(raw: Any, step: Any, where: str) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_COUNT:
        raise ManifestError(f"{where}: 'bases' must be a JSON object of step -> checkpoint id")
    for base, cid in raw.items():
        if not (isinstance(base, str) and _STEP.fullmatch(base)) or not (isinstance(cid, str) and _CID.fullmatch(cid)):
            raise ManifestError(f"{where}: 'bases' holds {str(base)[:24]!r}: {str(cid)[:24]!r}, "
                                "not a step and a 12-hex checkpoint id")
        if not isinstance(step, int) or int(base) >= step:
            raise ManifestError(f"{where}: base step {base} is not older than the manifest's step {step}")
    return dict(raw)


def _digests(raw: Any, where: str) -> dict[str, dict[Box, str]] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > MAX_COUNT:
        raise ManifestError(f"{where}: 'digests' must be a JSON object of item -> rows")
    out: dict[str, dict[Box, str]] = {}
    for name, rows in raw.items():
        if not isinstance(rows, list) or len(rows) > MAX_COUNT:
            raise ManifestError(f"{where}: digests of item {str(name)[:40]!r} must be a list")
        mine = out[name] = {}
        for row in rows:
            here = f"{where}: a digest of item {str(name)[:40]!r}"
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[2], str) and _DIGEST.fullmatch(row[2])):
                raise ManifestError(f"{here} is not [offsets, shape, sha256 hex]")
            mine[(check_dims(row[0], "offsets", here), check_dims(row[1], "shape", here))] = row[2]
    return out


def encode_refs(manifest: Manifest) -> dict[str, Any]:
    """The fields :func:`decode_refs` reads back (none for a manifest that uses neither)."""
    doc: dict[str, Any] = {}
    if manifest.bases:
        doc["bases"] = dict(sorted(manifest.bases.items(), key=lambda kv: int(kv[0])))
    if manifest.digests:
        doc["digests"] = {name: [[list(o), list(s), d] for (o, s), d in sorted(rows.items())]
                          for name, rows in manifest.digests.items()}
    return doc


def check_foreign_keys(manifest: Manifest, step_dir: str, where: str) -> None:
    """ManifestError unless every key of ``manifest`` outside ``step_dir`` lies in one of its bases.

    A manifest without bases must keep every key in its own step (a copied or moved
    manifest otherwise restores, and deletes, another step's objects)."""
    bases = manifest.bases or {}
    for key in manifest.keys():
        there = step_of_key(key)
        if there == step_dir:
            continue
        if there is None or there not in bases:
            raise ManifestError(f"{where}: object {key!r} lies outside this checkpoint's step "
                                "(copied or moved from elsewhere?)")
        if key in {f.key for f in manifest.fragments or []}:
            raise ManifestError(f"{where}: fragment {key!r} lies outside this checkpoint's step")


def referenced(manifest: Manifest, base_dir: str) -> set[str]:
    """The keys of step ``base_dir`` that ``manifest`` references (its objects lying there)."""
    if not manifest.bases or base_dir not in manifest.bases:
        return set()
    return {k for k in manifest.objects if step_of_key(k) == base_dir}
