"""Test helpers: read, edit and rewrite saved manifests as a bug, an attacker or an older ckptio would."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptio.manifest import MANIFEST_NAME, ROWS_VERSION, item_row, seal, unseal


def manifest_doc(root: Path, step: int) -> dict[str, Any]:
    return json.loads(unseal((root / str(step) / MANIFEST_NAME).read_bytes(), "test"))


def edit_manifest(root: Path, fn: Callable[[dict[str, Any]], Any], step: int = 1) -> None:
    """Edit a manifest consistently, checksum included."""
    path = root / str(step) / MANIFEST_NAME
    doc = json.loads(unseal(path.read_bytes(), "test"))
    fn(doc)
    path.write_bytes(seal(doc))


def packed(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every member of a format-5 manifest's pack tables: its dtype, shape, object, offset in it,
    crc, origin and host, by name."""
    out = {}
    for t in doc.get("packs", []):
        start = 0
        for name, shape, end, crc in zip(t["names"], t["shapes"], t["ends"], t["crcs"]):
            out[name] = {"dtype": t["dtype"], "shape": shape, "object": t["object"], "offset": t["offset"] + start,
                         "length": end - start, "crc": crc, "origin": t["origin"], "host": t["host"]}
            start = end
    return out


def as_rows(doc: dict[str, Any]) -> dict[str, Any]:
    """A format-5 manifest rewritten in place as format 4, its packs' members compact rows (what a
    ckptio of format 4 wrote, and what multi-host saves still write)."""
    for name, m in packed(doc).items():
        doc["items"][name] = item_row(m["dtype"], m["shape"], m["object"], m["offset"], [m["crc"]], m["host"],
                                      m["origin"])
    doc.pop("packs", None)
    doc["version"] = ROWS_VERSION
    return doc
