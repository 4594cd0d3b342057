"""The read path's shortcuts keep their promises: nothing skipped, nothing stale."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest

import ckptio.backends as backends
from ckptio.backends.local import LocalBackend
from ckptio.backends.memory import MemoryBackend


@pytest.fixture
def fresh_plugins() -> Any:
    backends._plugins.cache_clear()
    yield
    backends._plugins.cache_clear()


def test_backend_entry_points_are_read_once_per_process_and_still_override(monkeypatch: Any, fresh_plugins: Any) -> None:
    calls = []

    def fake_entry_points(group: str) -> list[EntryPoint]:
        calls.append(group)
        return [EntryPoint("file", "ckptio.backends.memory:MemoryBackend", group)]

    monkeypatch.setattr(backends, "entry_points", fake_entry_points)
    assert backends.backend_class("file") is MemoryBackend  # a plugin overrides a built-in scheme
    assert backends.backend_class("file") is MemoryBackend
    assert backends.backend_class("mem") is MemoryBackend
    with pytest.raises(ValueError, match="no ckptio backend"):
        backends.backend_class("nope")
    assert calls == ["ckptio.backends"]  # one scan, however many stores a process opens


def test_the_builtin_local_backend_without_plugins(monkeypatch: Any, fresh_plugins: Any) -> None:
    monkeypatch.setattr(backends, "entry_points", lambda group: [])
    assert backends.backend_class("file") is LocalBackend
