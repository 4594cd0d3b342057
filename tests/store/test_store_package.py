"""The store as a package: its options, its retries in one place, a custom naming's ownership, no cycles.

* :class:`RetryingBackend` passes the conformance suite, retries a transient failure with the
  engine's policy and gives up after ``retries``; the store's own calls go through it once.
* A custom :class:`~ckptio.engine.layout.Naming` that proves its keys (``parse_object``) gets its dead
  attempts collected by gc; one that does not keeps them (never deleted by guess).
* ``ckptio.store`` and its services import downwards only.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from paths import REPO
from tests.scenarios.test_never_lose import _RefuseCommit, same, state

import ckptio
from ckptio.backends import RetryableError, open_backend
from ckptio.backends import memory as memory_module
from ckptio.backends.base import Backend, join_key
from ckptio.backends.memory import MemoryBackend
from ckptio.backends.retrying import RetryingBackend, RetryPolicy
from ckptio.backends.wrappers import FaultInjectingBackend
from ckptio.engine import EngineConfig, run_sync
from ckptio.engine.layout import Naming
from ckptio.manifest.names import ObjectName, parse_object
from ckptio.store import CheckpointStore, StoreOptions
from ckptio.testing import BackendConformance

STORE = REPO / "ckptio" / "store"


class TestRetryingConformance(BackendConformance):
    def make_backend(self, tmp_path: Path) -> Backend:
        return RetryingBackend(MemoryBackend(f"mem://{tmp_path}"))

    @pytest.fixture(autouse=True)
    def _forget_stores(self, tmp_path: Path) -> Iterator[None]:
        yield
        for url in [u for u in memory_module._STORES if u.startswith(f"mem://{tmp_path}")]:
            MemoryBackend.forget(url)


def test_retrying_backend_retries_transient_faults_and_gives_up_after_its_retries(tmp_path: Path) -> None:
    inner = MemoryBackend(f"mem://{tmp_path}")
    try:
        flaky = FaultInjectingBackend(inner, rate=0.5, seed=3)
        patient = RetryingBackend(flaky, RetryPolicy(retries=30, backoff_initial=0.0, backoff_max=0.0))
        for i in range(20):
            asyncio.run(patient.write(f"k{i}", [memoryview(b"x" * i)]))
            assert asyncio.run(patient.read(f"k{i}")) == b"x" * i
        assert flaky.injected
        hopeless = RetryingBackend(FaultInjectingBackend(inner, rate=1.0), RetryPolicy(2, 0.0, 0.0))
        with pytest.raises(RetryableError):
            asyncio.run(hopeless.stat("k1"))
        with pytest.raises(FileNotFoundError):  # not retryable: at once
            asyncio.run(patient.stat("absent"))
    finally:
        MemoryBackend.forget(f"mem://{tmp_path}")


def test_the_store_retries_with_the_engines_policy_once(tmp_path: Path) -> None:
    flaky = FaultInjectingBackend(open_backend(str(tmp_path)), rate=0.3, seed=7)
    store = CheckpointStore(str(tmp_path), backend=flaky, engine_config=EngineConfig(retries=40, backoff_initial=0.0))
    try:
        # Between the retries and the backend: its deadlines (ckptio.backends.deadline).
        assert isinstance(store.io, RetryingBackend) and store.io.inner.inner is flaky and store.backend is flaky
        assert store.io.policy.retries == 40
        for s in range(5):
            run_sync(store.announce(str(s), f"{s:012x}", 0, 60.0))
        assert run_sync(store.step_dirs()) == [0, 1, 2, 3, 4]
        assert flaky.injected
    finally:
        run_sync(store.close())


def test_options_are_frozen_and_variants_are_new_stores(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path) + "/")
    try:
        assert store.url == str(tmp_path) and not store.host_local and store.reopenable
        with pytest.raises(dataclasses.FrozenInstanceError):
            store.options.host_local = True  # type: ignore[misc]
        with pytest.raises(AttributeError):
            store.host_local = True  # type: ignore[misc]
        local = store.derive(host_local=True)
        other = store.sibling(tmp_path / "other")
        assert local.host_local and local.url == store.url and other.url == str(tmp_path / "other")
        for s in (local, other):
            run_sync(s.close())
    finally:
        run_sync(store.close())
    with pytest.raises(ValueError, match="empty"):
        StoreOptions("  ")


def test_sweep_step_refuses_a_step_that_is_not_an_int(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    try:
        for bad in (None, True, "3"):
            with pytest.raises(ValueError, match="sweep"):
                run_sync(store.sweep_step(bad, 0))  # type: ignore[arg-type]
    finally:
        run_sync(store.close())


@dataclasses.dataclass(frozen=True)
class ShelfNaming(Naming):
    """A custom shape, ``<step>/shelf/<save id>-<host>-<n>.bin``, that proves its own keys."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return join_key(step_dir, "shelf", f"{save_id}-{host}-{n}.bin")

    def parse_object(self, key: str) -> ObjectName | None:
        step, _, rest = key.rpartition("/shelf/")
        sid, _, tail = rest.partition("-")
        if not tail.endswith(".bin") or "/" in step or (step and not step.isdigit()):
            return None
        return ObjectName(step, sid)


@dataclasses.dataclass(frozen=True)
class SilentShelf(Naming):
    """The same shape, without a proof of ownership."""

    def object_key(self, step_dir: str, save_id: str, host: int, num_hosts: int, n: int) -> str:
        return ShelfNaming().object_key(step_dir, save_id, host, num_hosts, n)


def _shelf_root(tmp_path: Path, naming: Naming, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    monkeypatch.setenv("CKPTIO_LEASE_S", "0.2")
    url = str(tmp_path)
    with pytest.raises(ConnectionAbortedError):
        ckptio.save(url, state(4), step=4, naming=naming, backend=_RefuseCommit(open_backend(url))).result()
    dead = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "4" / "shelf").iterdir())
    ckptio.save(url, state(4), step=4, naming=naming).result()
    old = time.time() - 3600
    for key in dead:
        os.utime(tmp_path / key, (old, old))
    return url, dead


def test_gc_collects_a_custom_namings_dead_attempt_when_the_naming_proves_its_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    naming = ShelfNaming()
    url, dead = _shelf_root(tmp_path, naming, monkeypatch)
    assert dead and all(parse_object(k) is None and parse_object(k, naming) is not None for k in dead)
    store = CheckpointStore(url, naming=naming)
    try:
        report = run_sync(store.sweep(60))
    finally:
        run_sync(store.close())
    assert set(dead) <= set(report.objects)
    assert not any((tmp_path / k).exists() for k in dead)
    assert same(ckptio.restore(url, 4), 4)


def test_a_custom_naming_without_a_proof_keeps_its_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, dead = _shelf_root(tmp_path, SilentShelf(), monkeypatch)
    store = CheckpointStore(url, naming=SilentShelf())
    try:
        report = run_sync(store.sweep(60))
    finally:
        run_sync(store.close())
    assert not set(dead) & set(report.objects) and all((tmp_path / k).exists() for k in dead)


def _imports(path: Path) -> set[str]:
    """The ``ckptio.store`` modules ``path`` imports at module level."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptio.store."):
            out.add(node.module.split(".")[2])
    return out


def test_the_store_package_imports_downwards_only() -> None:
    modules = {p.stem: _imports(p) for p in STORE.glob("*.py") if p.stem != "__init__"}
    order = ["urls", "fence", "pins", "orbax_steps", "transaction", "options", "companions", "context", "manifests",
             "objects", "intents", "parts", "catalog", "unchanged", "deletion", "commit", "gc", "resave", "facade"]
    assert sorted(modules) == sorted(order)
    for name, deps in modules.items():
        assert all(order.index(d) < order.index(name) for d in deps), (name, deps)
    for path in STORE.glob("*.py"):  # and no import hidden inside a function to dodge a cycle
        functions = [f for f in ast.walk(ast.parse(path.read_text()))
                     if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        nested = [n for f in functions for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)]
        assert not nested, path

