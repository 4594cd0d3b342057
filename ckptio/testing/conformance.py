"""The backend conformance suite: one base test class that every backend's test file subclasses.

The checks live in groups (:mod:`._io_checks`, :mod:`._filling_checks`, :mod:`._namespace_checks`,
:mod:`._lifecycle_checks`, :mod:`._conditional_checks`) on one harness
(:mod:`._harness`); this class joins them.

It checks each point of the contract in :mod:`ckptio.backends.base`, plus a
Hypothesis state machine that drives the backend and a dict model with the
same random operations and compares them after every step.

A backend's test file provides ``make_backend``; everything else is inherited::

    from ckptio.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        async def make_backend(self, tmp_path):        # may also be a plain def
            return MyBackend(f"my://test-bucket{tmp_path}")  # tmp_path: unique per test

How the suite drives a backend:

* Each test runs in its own event loop (``asyncio.run``; no pytest-asyncio),
  and ``make_backend`` is called *inside* that loop, so a backend may bind
  sessions to the running loop. ``close_backend`` is awaited at the end.
* ``make_backend(tmp_path)`` must return a backend over empty storage that
  no other test sees. Calling it again with the same ``tmp_path`` must give
  another client of the *same* storage (two clients of one bucket): the
  commit race runs across several instances. The state machine calls it
  with fresh sub-directories of ``tmp_path``, one per example.
* Fixtures the backend needs (a fake server, a mount) come in through an
  autouse fixture defined on the subclass; pytest binds it to the same
  instance as the test, so it can store them on ``self``.
* A read-only backend (``capabilities.read_only``) skips the tests of the
  write path and runs the read-path tests on data seeded through
  :meth:`BackendConformance.writer_for`, which it overrides to return a
  writable client of the same storage.
* Sizes and counts are class attributes, so a slow backend can shrink them;
  a test that cannot apply is overridden in the subclass with a skipped one.

Not required (file systems cannot do it): an object and a "directory" of the
same name (``a`` and ``a/b``) at once. No test stores both.
"""

from __future__ import annotations

from ckptio.testing._conditional_checks import ConditionalDeleteChecks
from ckptio.testing._filling_checks import FillingChecks
from ckptio.testing._harness import backend_test
from ckptio.testing._io_checks import ByteChecks
from ckptio.testing._lifecycle_checks import LifecycleChecks
from ckptio.testing._namespace_checks import NamespaceChecks
from ckptio.testing.model import split_views

__all__ = ["BackendConformance", "backend_test", "split_views"]


class BackendConformance(ByteChecks, FillingChecks, NamespaceChecks, LifecycleChecks,
                         ConditionalDeleteChecks):
    """The shared conformance tests. Subclass it and implement :meth:`make_backend`."""
