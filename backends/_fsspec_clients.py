"""What ckptio knows of the clients under fsspec filesystems: their errors, and how to close them.

fsspec has no common error classes nor a close API: s3fs, gcsfs, adlfs and the HTTP stacks
under them (aiohttp, botocore, requests) each have their own. Both are kept here, by name
where possible, so that none of those packages has to be importable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
from typing import Any

from ckptio.backends.base import RetryableError, ThrottledError

__all__ = ["close_filesystem", "http_status", "translate_error"]


# -- error translation ------------------------------------------------------------------

#: Transient failures of the HTTP stacks under fsspec filesystems, by qualified class name so
#: that none of those packages has to be importable (any class in an error's MRO counts).
_TRANSIENT_CLASSES = frozenset({
    "aiohttp.client_exceptions.ClientConnectionError",  # resets, refused, server timeouts
    "aiohttp.client_exceptions.ClientPayloadError",  # a body cut off
    "botocore.exceptions.HTTPClientError",  # ConnectionClosedError, ReadTimeoutError, ...
    "botocore.exceptions.ConnectionError",  # EndpointConnectionError, ConnectTimeoutError
    "requests.exceptions.ConnectionError",
    "requests.exceptions.Timeout",
    "requests.exceptions.ChunkedEncodingError",
    "google.auth.exceptions.TransportError",
    "gcsfs.retry.ChecksumError",  # damaged in transit: sending or fetching again repairs it
})  # fmt: skip
#: errno values s3fs gives throttling and server errors (SlowDown, ServiceUnavailable, InternalError).
_TRANSIENT_ERRNOS = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, getattr(errno, "EREMOTEIO", errno.EIO)}
)


def http_status(e: BaseException) -> int | None:
    """The HTTP status an error carries, if any (gcsfs HttpError.code, aiohttp .status, botocore)."""
    for err in (e, e.__cause__):
        if err is None:
            continue
        for attr in ("code", "status"):
            value = getattr(err, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
    return None


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}
    if names & _TRANSIENT_CLASSES:
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


#: What s3fs (``translate_boto_error``) says when S3 throttles: OSError(EBUSY, <the S3 error code>).
#: EBUSY alone is not throttling (s3fs also maps "OperationAborted", a conflicting operation, to it).
_THROTTLE_CODES = ("SlowDown", "Throttl", "TooManyRequests", "RequestLimitExceeded")


def _is_throttled(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno == errno.EBUSY and any(c in str(e) for c in _THROTTLE_CODES)


def translate_error(e: BaseException, what: str) -> BaseException:
    """The contract's exception for a filesystem's ``e``, its message led by ``what`` (URL and key)."""
    if isinstance(e, RetryableError) or str(e).startswith(what):
        return e  # ours already (raised inside the translated block)
    detail = f"{type(e).__name__}: {e}"
    if isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return FileNotFoundError(f"{what}: no such object ({detail})")
    if isinstance(e, FileExistsError):
        return FileExistsError(f"{what}: object exists ({detail})")
    status = http_status(e)
    if status is not None:
        if status == 404:
            return FileNotFoundError(f"{what}: no such object (HTTP 404: {e})")
        if status == 412:
            return FileExistsError(f"{what}: object exists (HTTP 412: {e})")
        if status in (401, 403):
            return PermissionError(f"{what}: HTTP {status}: {e}")
        if status in (429, 503):  # "slow down": the request budget lowers this host's rate
            return ThrottledError(f"{what}: HTTP {status}: {e}")
        if status == 408 or status >= 500:
            return RetryableError(f"{what}: HTTP {status}: {e}")
        if status == 416:
            return ValueError(f"{what}: runs past the end (HTTP 416)")
    if _is_throttled(e):
        return ThrottledError(f"{what}: {detail}")
    if _is_transient(e):
        return RetryableError(f"{what}: {detail}")
    if isinstance(e, PermissionError) or (
        isinstance(e, OSError) and (e.errno in (errno.EACCES, errno.EPERM) or str(e).startswith("Forbidden"))
    ):  # gcsfs says 403 as OSError("Forbidden: ...")
        return PermissionError(f"{what}: {detail}")
    if isinstance(e, ValueError):
        return ValueError(f"{what}: {detail}")
    return OSError(f"{what}: {detail}")


# -- closing a filesystem ------------------------------------------------------------------


async def close_filesystem(fs: Any) -> None:
    """Close an async filesystem's connections; fsspec has no API for it, so each client's own way."""
    creator = getattr(fs, "_s3creator", None)  # s3fs: the aiobotocore client's context manager
    if creator is not None:
        with contextlib.suppress(Exception):
            await creator.__aexit__(None, None, None)
        fs._s3 = None
    session = getattr(fs, "_session", None)  # gcsfs, fsspec's HTTP filesystem: an aiohttp session
    if session is not None and hasattr(session, "close") and not getattr(session, "closed", True):
        with contextlib.suppress(Exception):
            await session.close()
    closer = getattr(fs, "close", None)  # adlfs and others that offer one
    if closer is not None and inspect.iscoroutinefunction(closer):
        with contextlib.suppress(Exception):
            await closer()
