"""Sealing: a manifest (or fragment) as stored, checksummed over the exact bytes of its body.

``{"crc32c":"<8 hex digits>","manifest":<body>}``. The checksum covers the
body byte for byte, so a flipped byte that still parses as JSON (a digit of a
shape, say) is caught too.
"""

from __future__ import annotations

from typing import Any

from ckptio.errors import IntegrityError, ManifestError
from ckptio.system import jsonio as _json
from ckptio.system.checksum import crc32c

__all__ = ["seal", "unseal"]

_SEAL_HEAD, _SEAL_TAIL = b'{"crc32c":"', b'","manifest":'
_SEAL_LEN = len(_SEAL_HEAD) + 8 + len(_SEAL_TAIL)


def seal(doc: dict[str, Any]) -> bytes:
    """A manifest document as stored: JSON whose ``manifest`` member is checksummed byte for byte."""
    body = _json.dumps(doc)
    return b"%s%08x%s%s}" % (_SEAL_HEAD, crc32c(body), _SEAL_TAIL, body)


def unseal(data: bytes, where: str) -> bytes:
    """The body of a sealed manifest; IntegrityError naming ``where`` if its checksum fails."""
    head = data[:_SEAL_LEN]
    n = len(_SEAL_HEAD)
    if len(data) <= _SEAL_LEN or head[:n] != _SEAL_HEAD or head[n + 8 :] != _SEAL_TAIL or data[-1:] != b"}":
        raise ManifestError(f"{where}: manifest is not valid JSON of the ckptio format (no sealed body)")
    body = data[_SEAL_LEN:-1]
    try:
        expected = int(head[n : n + 8], 16)
    except ValueError:
        raise ManifestError(f"{where}: manifest checksum field is malformed") from None
    if crc32c(body) != expected:
        raise IntegrityError(f"checksum mismatch in manifest {where}: the object is corrupt", key=where)
    return body
