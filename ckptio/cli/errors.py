"""The command's failures: one line each, and an exit status per kind (:data:`EXIT_CODES`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ckptio.errors import IntegrityError, ManifestError

__all__ = ["EXIT_CODES", "CliError", "kind_of", "one_line", "report"]


#: Exit statuses: each kind of failure has its own, so scripts can tell them apart.
EXIT_CODES = {
    "ok": 0,
    "failed": 1,       # anything else (the message says what)
    "usage": 2,        # a bad command line or URL (argparse's own status)
    "not-found": 3,    # no checkpoint / step / path there
    "damaged": 4,      # a manifest or an object fails its checks
    "unreachable": 5,  # the storage did not answer (connection refused, timeouts)
    "denied": 6,       # no permission, no credentials, a read-only storage
}


class CliError(Exception):
    """A failure the command reports as its answer: one line and the exit status of ``kind``."""

    def __init__(self, kind: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.extra = extra


def kind_of(e: BaseException) -> str:
    """The exit-status kind of an exception raised while a command ran."""
    from ckptio.backends import RetryableError

    if isinstance(e, CliError):
        return e.kind
    if isinstance(e, (IntegrityError, ManifestError)):
        return "damaged"
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return "not-found"
    if isinstance(e, PermissionError):
        return "denied"
    if isinstance(e, (RetryableError, ConnectionError, TimeoutError)) or type(e).__module__.startswith("aiohttp"):
        return "unreachable"
    if isinstance(e, argparse.ArgumentError):
        return "usage"
    return "failed"


def one_line(e: BaseException, url: str | None) -> str:
    """The exception as one line that names ``url`` (most messages already start with it)."""
    text = " ".join(str(e).split()) or type(e).__name__
    if url and url not in text and not isinstance(e, CliError):
        text = f"{url}: {text}"
    return text


def report(e: BaseException, kind: str, url: str | None, as_json: bool) -> int:
    """Print ``e`` as the command's one-line answer (or JSON); return its exit status."""
    message = one_line(e, url)
    if as_json:
        doc: dict[str, Any] = {"ok": False, "error": message, "kind": kind, "exit": EXIT_CODES[kind],
                               "type": type(e.__cause__ if isinstance(e, CliError) and e.__cause__ else e).__name__}
        if url:
            doc["url"] = url
        if isinstance(e, IntegrityError):
            doc.update(object=e.key, item=e.item)
        if isinstance(e, CliError):
            doc.update({k: v for k, v in e.extra.items() if v is not None})
        print(json.dumps(doc))
    else:
        print(f"ckptio: error: {message}", file=sys.stderr)
    return EXIT_CODES[kind]
