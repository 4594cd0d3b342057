"""Where the suite's parts lie, for a test that starts a script or reads a file of the suite.

Tests mirror the packages (``tests/<package>/test_<module>.py``), so a test's own folder says nothing
about where the scripts it starts are: they are in ``tests/workers/`` (one process of a multi-process
test), ``tests/scenarios/`` (campaigns and scenario programs), the helpers in ``tests/support/``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FIXTURES", "REPO", "SCENARIOS", "SUPPORT", "TESTS", "WORKERS"]

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
WORKERS = TESTS / "workers"
SCENARIOS = TESTS / "scenarios"
SUPPORT = TESTS / "support"
FIXTURES = TESTS / "fixtures"
