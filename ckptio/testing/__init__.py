"""A kit for proving a storage backend against ckptio's contract (needs ``pytest`` and ``hypothesis``).

A third-party backend (registered under the ``ckptio.backends`` entry-point
group) subclasses :class:`BackendConformance` in its own test suite and
provides ``make_backend``; the inherited tests check every point of the
contract in :mod:`ckptio.backends.base`, and a Hypothesis state machine
compares the backend with a dict model::

    from ckptio.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        def make_backend(self, tmp_path):
            return MyBackend(f"my://{tmp_path}")

The wrapper backends are here too, for a backend's own tests:
:class:`FaultInjectingBackend` (errors and corruption on chosen calls),
:class:`LatencyBackend` (added delay), :class:`CountingBackend` (calls and
bytes per method) and :class:`ReadOnlyBackend`. ckptio's own backends run
this very suite (``tests/backends/``), and so does the example
backend of the README's "Write a backend" (``tests/support/example_backend.py``).
"""

from __future__ import annotations

from ckptio.backends.wrappers import (
    CountingBackend, FaultInjectingBackend, LatencyBackend, MethodStats, ReadOnlyBackend, WrapperBackend,
)
from ckptio.testing.conformance import BackendConformance, backend_test
from ckptio.testing.model import machine_for, split_views
from ckptio.testing.resume import ResumeReport, check_resume

__all__ = [
    "BackendConformance",
    "ResumeReport",
    "check_resume",
    "CountingBackend",
    "FaultInjectingBackend",
    "LatencyBackend",
    "MethodStats",
    "ReadOnlyBackend",
    "WrapperBackend",
    "backend_test",
    "machine_for",
    "split_views",
]
