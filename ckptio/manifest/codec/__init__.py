"""The manifest codecs, behind one version table: ``decode`` dispatches, ``encode`` picks.

:func:`decode` reads any document this ckptio can (versions 1 to
:data:`~ckptio.manifest.formats.VERSION`, see :mod:`ckptio.manifest.formats`):
a format-2 root (version 2, or 3 and up with ``fragments``) goes to
:mod:`.split`, every one-document manifest to :mod:`.single`. :func:`encode`
writes a whole manifest as one document in the lowest version that can express
it. Registered with the model on import, so that ``Manifest.from_json`` & co.
reach it.
"""

from __future__ import annotations

import sys
from typing import Any

from ckptio.errors import ManifestError
from ckptio.manifest import formats
from ckptio.manifest.codec import single, split
from ckptio.manifest.limits import MAX_MANIFEST_BYTES
from ckptio.manifest.model import Manifest, use_codec
from ckptio.manifest.sealing import seal, unseal
from ckptio.system import jsonio as _json

__all__ = ["decode", "decode_json", "encode", "encode_json"]


def decode(doc: Any, where: str) -> Manifest:
    """Validate a parsed manifest document of any supported version; ManifestError naming ``where``."""
    if not isinstance(doc, dict) or doc.get("format") != formats.FORMAT:
        raise ManifestError(f"{where}: not a ckptio manifest")
    version = doc.get("version")
    newest = formats.VERSION  # read at call time: a test may lower it to play an older reader
    if not isinstance(version, int) or version < 1 or version > newest:
        raise ManifestError(
            f"{where}: manifest version {version!r} is not supported by this ckptio (reads <= {newest})"
        )
    if version == formats.FRAGMENTS_VERSION or (version >= formats.TILED_VERSION and "fragments" in doc):
        return split.root_from_doc(doc, where)
    return single.from_doc(doc, version, where)


def decode_json(data: bytes, where: str) -> Manifest:
    """Parse and validate a stored (sealed) manifest; ManifestError naming ``where`` (its URL) on any fault."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    body = unseal(data, where)
    try:
        doc = _json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{where}: manifest is not valid JSON: {e}") from e
    except RecursionError:
        raise ManifestError(f"{where}: manifest is nested too deeply to be a ckptio manifest") from None
    try:
        return decode(doc, where)
    except ManifestError:
        raise
    except RecursionError:
        raise ManifestError(f"{where}: manifest tree is nested too deeply") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ManifestError(f"{where}: malformed manifest: {type(e).__name__}: {e}") from e


def encode(manifest: Manifest) -> dict[str, Any]:
    """A whole manifest as one JSON-able document (format 1, or 3 with tiled shards)."""
    return single.encode(manifest)


def encode_json(manifest: Manifest) -> bytes:
    """A whole manifest as stored: :func:`encode`, sealed."""
    return seal(encode(manifest))


use_codec(sys.modules[__name__])  # type: ignore[arg-type]
