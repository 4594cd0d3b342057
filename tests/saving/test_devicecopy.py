"""Device snapshots (ckptio.saving.devicecopy): a save of jax arrays copies them on their device,
returns, and moves the bytes to the host behind the step; a step that donates its inputs right
after the save returns cannot touch the checkpoint. On CPU devices with ``device_snapshot="device"``
(the path an accelerator takes by default), and under the default on CPU (host views, no copy)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import ckptio  # noqa: E402
from ckptio import SaveOptions  # noqa: E402
from ckptio.saving import devicecopy  # noqa: E402
from ckptio.saving.devicecopy import Headroom, Snapshots  # noqa: E402

DEVICE = SaveOptions(device_snapshot="device")


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((512, 1024), dtype=np.float32)),  # 2 MiB
            "b": jnp.asarray(rng.integers(0, 1 << 30, 1 << 17, dtype=np.int32)),  # 512 KiB: not packed
            "step": 7}


@jax.jit
def _bump(w: Any) -> Any:
    return w * 2.0 + 1.0


_donating_step = jax.jit(lambda w, b: (w * 2.0 + 1.0, b + 3), donate_argnums=(0, 1))


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every device copy the saves make, recorded."""
    made: list[Any] = []
    real = devicecopy._device_copy

    def spy(shard: Any) -> Any:
        made.append(real(shard))
        return made[-1]

    monkeypatch.setattr(devicecopy, "_device_copy", spy)
    return made


@pytest.mark.parametrize("options", [None, DEVICE, SaveOptions(device_snapshot="host")], ids=["auto", "device", "host"])
def test_a_step_that_donates_its_inputs_right_after_the_save_returns_leaves_the_checkpoint_exact(
        tmp_path: Path, options: SaveOptions | None) -> None:
    state = _state()
    want = {k: np.asarray(v) for k, v in state.items() if k != "step"}
    handle = ckptio.save(tmp_path, state, step=1, save_options=options)
    w, b = _donating_step(state["w"], state["b"])  # may reuse the arrays' buffers at once
    w, b = _donating_step(w, b)
    handle.result()
    got = ckptio.restore(tmp_path, 1)
    assert np.array_equal(got["w"], want["w"]) and np.array_equal(got["b"], want["b"]) and got["step"] == 7
    assert not np.array_equal(np.asarray(w), want["w"])  # the step did run on


def test_device_snapshots_are_taken_before_the_save_returns_and_freed_once_on_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _copies(monkeypatch)
    state = _state(1)
    want = np.asarray(state["w"])
    handle = ckptio.save(tmp_path, state, step=1, save_options=DEVICE)
    assert len(made) == 2  # one per array (one device, one shard each), all taken inside the stall
    handle.result()
    assert all(s.is_deleted() for s in made)  # device memory back once the bytes were staged
    made.clear()
    gc.collect()
    assert not devicecopy._OWNED  # and nothing of ckptio's holds them
    assert np.array_equal(ckptio.restore(tmp_path, 1)["w"], want)


def test_no_device_memory_to_spare_crosses_to_the_host_in_the_stall(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _copies(monkeypatch)
    monkeypatch.setattr(Headroom, "_free", classmethod(lambda cls, device: 600 << 10))  # room for "b" only
    state = _state(2)
    ckptio.save(tmp_path, state, step=1, save_options=DEVICE).result()
    assert [s.shape for s in made] == [(1 << 17,)]  # "w" (2 MiB) did not fit: it crossed to the host
    got = ckptio.restore(tmp_path, 1)
    assert np.array_equal(got["w"], np.asarray(state["w"])) and np.array_equal(got["b"], np.asarray(state["b"]))


def test_a_device_copy_that_fails_falls_back_to_the_host_and_the_save_still_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(shard: Any) -> Any:
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 2097152 bytes")

    monkeypatch.setattr(devicecopy, "_device_copy", out_of_memory)
    state = _state(3)
    ckptio.save(tmp_path, state, step=1, save_options=DEVICE).result()
    assert np.array_equal(ckptio.restore(tmp_path, 1)["w"], np.asarray(state["w"]))


def test_none_reads_the_arrays_themselves_and_refuses_a_deleted_one(tmp_path: Path) -> None:
    """``"none"``: no copy, the bytes cross from the caller's own arrays, which stay the caller's. (Deleting
    one while its bytes cross is the broken promise the option names: jax itself may crash then.)"""
    state = _state(4)
    want = np.asarray(state["w"]).copy()
    fresh = {"w": state["w"] + 0, "b": state["b"] + 0}
    ckptio.save(tmp_path, fresh, step=1, save_options=SaveOptions(device_snapshot="none")).result()
    assert np.array_equal(ckptio.restore(tmp_path, 1)["w"], want) and not fresh["w"].is_deleted()  # not ours
    gone = _bump(state["w"])
    gone.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        ckptio.save(tmp_path, {"w": gone}, step=2, save_options=SaveOptions(device_snapshot="none"))
    assert ckptio.CheckpointManager(tmp_path).all_steps() == [1]  # refused before anything was written


def test_headroom_leaves_the_steps_working_memory_and_a_margin() -> None:
    class Device:
        id, platform = 0, "tpu"

        def __init__(self, stats: dict[str, int] | None) -> None:
            self.stats = stats

        def memory_stats(self) -> dict[str, int] | None:
            return self.stats

    Headroom.working.pop(0, None)
    gib = 1 << 30
    tpu = Device({"bytes_limit": 16 * gib, "bytes_in_use": 6 * gib, "peak_bytes_in_use": 8 * gib})
    room = Headroom()
    free = 16 * gib - 6 * gib - 2 * gib - int(16 * gib * devicecopy.MARGIN)  # limit - in use - working - margin
    assert room.take(tpu, free) and not room.take(tpu, 1)
    tpu.stats = {"bytes_limit": 16 * gib, "bytes_in_use": 6 * gib, "peak_bytes_in_use": 14 * gib}  # our snapshots
    assert Headroom().take(tpu, free)  # the step's working memory is the one measured at the first save
    assert not Headroom().take(Device(None), 1)  # an accelerator without stats: no room proven
    Headroom.working.pop(0, None)


def test_a_bad_policy_is_named() -> None:
    with pytest.raises(ValueError, match="device_snapshot='gpu'"):
        SaveOptions(device_snapshot="gpu")
    with pytest.raises(ValueError, match="device_snapshot='gpu'"):
        Snapshots("gpu")


def test_under_orbax_the_snapshot_is_taken_in_the_stall_and_freed_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    import ckptio.orbax

    made = _copies(monkeypatch)
    state = _state(5)
    want = {k: np.asarray(v) for k, v in state.items() if k != "step"}
    registry = ckptio.orbax.handler_registry(save_options=DEVICE)
    with ocp.CheckpointManager(tmp_path / "orbax", handler_registry=registry) as mngr:
        mngr.save(1, args=ckptio.orbax.Save(state))
        assert len(made) == 2  # taken by the save call itself
        _donating_step(state["w"], state["b"])
        mngr.wait_until_finished()
        assert all(s.is_deleted() for s in made)
        got = mngr.restore(1, args=ckptio.orbax.Restore())
    assert np.array_equal(np.asarray(got["w"]), want["w"]) and np.array_equal(np.asarray(got["b"]), want["b"])


SHARDED = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp, ckptio
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    w = jax.device_put(full, NamedSharding(mesh, P("x", "y")))
    r = jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mesh, P()))  # replicated
    step = jax.jit(lambda w, r: (w + 1, r * 2), donate_argnums=(0, 1))
    h = ckptio.save(sys.argv[1], {"w": w, "r": r}, step=1, save_options=ckptio.SaveOptions(device_snapshot=sys.argv[2]))
    w, r = step(w, r)
    h.result()
    got = ckptio.restore(sys.argv[1], 1)
    assert np.array_equal(got["w"], full) and np.array_equal(got["r"], np.arange(16)), "not bit-exact"
    print("ok")
""")


@pytest.mark.parametrize("policy", ["auto", "device"])
def test_sharded_arrays_on_eight_devices_donated_right_after_the_save(tmp_path: Path, policy: str) -> None:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SHARDED, str(tmp_path / policy), policy], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
