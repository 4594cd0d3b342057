"""Options of the GCS backend: small picklable dataclasses, and where requests go."""

from __future__ import annotations

import dataclasses
import os
from urllib.parse import urlsplit

__all__ = ["GCS_ENDPOINT", "GCSConfig", "RampConfig", "resolve_endpoint"]

GCS_ENDPOINT = "https://storage.googleapis.com"
_CHUNK_GRANULE = 256 << 10  # resumable chunks must be multiples of this


@dataclasses.dataclass(frozen=True)
class RampConfig:
    """The request-rate ramp (GCS request-rate guide); per process."""

    #: None: on for real GCS, off for an emulator.
    enabled: bool | None = None
    initial_writes_per_s: float = 500.0
    initial_reads_per_s: float = 2500.0
    doubling_s: float = 1200.0
    #: Upper bound of the ramp (None: none).
    max_per_s: float | None = None


@dataclasses.dataclass(frozen=True)
class GCSConfig:
    """Options of the GCS backend (picklable)."""

    #: JSON API endpoint; None: ``STORAGE_EMULATOR_HOST`` if set, else storage.googleapis.com.
    endpoint: str | None = None
    #: Send no credentials; None: anonymous iff the endpoint is not ``*.googleapis.com``.
    anonymous: bool | None = None
    #: Target object size for the layout.
    object_size: int = 64 << 20
    #: Requests in flight that keep GCS busy (the engine's concurrency).
    concurrency: int = 32
    #: Objects larger than this use a resumable upload, smaller ones one request.
    resumable_threshold: int = 96 << 20
    #: The one-request upload type: ``"media"`` (bytes only) or ``"multipart"`` (metadata + bytes).
    upload: str = "media"
    #: Resumable chunk size, a multiple of 256 KiB.
    chunk_size: int = 32 << 20
    #: Resume a failed chunk via a status query; None: on for real GCS, off for an emulator.
    resume_chunks: bool | None = None
    #: ``maxResults`` of a listing page (tests force pagination with small values).
    list_page_size: int = 1000
    #: Seconds to connect, and without a byte from the server once the request is sent.
    timeouts: tuple[float, float] = (30.0, 120.0)
    ramp: RampConfig = RampConfig()

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size % _CHUNK_GRANULE:
            raise ValueError(f"chunk_size must be a positive multiple of 256 KiB, got {self.chunk_size}")
        if self.list_page_size <= 0 or self.concurrency <= 0:
            raise ValueError("list_page_size and concurrency must be positive")
        if self.upload not in ("media", "multipart"):
            raise ValueError(f"upload must be 'media' or 'multipart', got {self.upload!r}")


def resolve_endpoint(config: GCSConfig) -> tuple[str, bool]:
    """``(endpoint URL, is an emulator)``; an emulator host without scheme gets ``http://``."""
    endpoint = config.endpoint or os.environ.get("STORAGE_EMULATOR_HOST") or GCS_ENDPOINT
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    endpoint = endpoint.rstrip("/")
    host = urlsplit(endpoint).hostname or ""
    return endpoint, not (host == "googleapis.com" or host.endswith(".googleapis.com"))
