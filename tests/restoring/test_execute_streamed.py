"""A restore onto accelerators streams (ckptio.restoring.executor.restore_streamed): its device-bound
leaves are read a group at a time, each group placed on its devices while the next is read. On CPU
devices here, with the accelerator check forced."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import ckptio  # noqa: E402
execute = importlib.import_module("ckptio.restoring.executor")


def test_device_bound_leaves_are_read_group_by_group_and_restore_bit_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"w{i}": np.random.default_rng(i).standard_normal((256, 256), dtype=np.float32) for i in range(6)}
    state["host"] = np.arange(10)  # a numpy target: read with the last group
    ckptio.save(tmp_path, state, step=1).result()
    monkeypatch.setattr(execute, "_accelerated", lambda sharding: True)
    monkeypatch.setattr(execute, "GROUP_BYTES", 600 << 10)  # two 256 KiB arrays a group
    groups: list[list[str]] = []
    real = execute.prepare

    def spy(store: Any, manifest: Any, step_dir: str, sel: Any, host: Any = None, numbers: Any = None) -> Any:
        groups.append(sorted(sel.wanted))
        return real(store, manifest, step_dir, sel, host, numbers)

    monkeypatch.setattr(execute, "prepare", spy)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
              for k, v in state.items() if k != "host"}
    target["host"] = np.zeros(10, np.int64)
    got = ckptio.restore(tmp_path, 1, target=target)
    assert groups == [["w0", "w1"], ["w2", "w3"], ["w4", "w5"], ["host"]]
    for k, v in state.items():
        assert np.array_equal(np.asarray(got[k]), v), k
    assert all(isinstance(got[f"w{i}"], jax.Array) for i in range(6))


def test_a_cpu_restore_or_a_small_one_does_not_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": np.ones((64, 64), np.float32)}
    ckptio.save(tmp_path, state, step=1).result()
    called: list[int] = []
    monkeypatch.setattr(execute, "restore_streamed", lambda *a, **k: called.append(1))
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    assert np.array_equal(np.asarray(ckptio.restore(tmp_path, 1, target=target)["w"]), state["w"])  # CPU devices
    monkeypatch.setattr(execute, "_accelerated", lambda sharding: True)
    assert np.array_equal(np.asarray(ckptio.restore(tmp_path, 1, target=target)["w"]), state["w"])  # one group only
    assert not called
