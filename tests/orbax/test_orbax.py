"""ckptio.orbax under Orbax's CheckpointManager: resharding, resume, the TypeHandler, retention, 2 processes.

The scenarios need 8 CPU devices, which must be configured before jax is
imported; other test files import jax with one device. So they run in
subprocesses (tests/scenarios/orbax_scenarios.py, tests/workers/orbax_mp_worker.py) and this
module only reads their verdicts -- it never imports jax itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import paths
import pytest

pytestmark = pytest.mark.slow  # Orbax scenarios run as fresh JAX programs, and a two-process jax.distributed job

# find_spec, not importorskip: importing jax here would fix this process's device count.
if importlib.util.find_spec("jax") is None or importlib.util.find_spec("orbax") is None:
    pytest.skip("needs jax and orbax-checkpoint", allow_module_level=True)

SCENARIOS = [
    "reshard_bitexact",
    "composite_resume",
    "type_handler",
    "retention_local",
    "retention_hashed_mem",
    "retention_gcs",
    "edge_cases",
]
DTYPE_SCENARIOS = [
    "numpy_int64_x64_off",
    "jax_int64_save_restore",
    "type_handler_int64",
    "type_handler_cast",
    "property_save_restore",
    "property_type_handler",
]


def _env() -> dict[str, str]:
    # One thread per process keeps two CPU cores from thrashing; the child sets XLA_FLAGS itself.
    return {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _run_scenarios(script: str, names: list[str], work: Path) -> dict[str, Any]:
    """Run ``names`` of ``script`` in one 8-device process (jax and Orbax import once); their verdicts."""
    proc = subprocess.run(
        [sys.executable, str(paths.SCENARIOS / script), str(work), *names],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    path = work / "results.json"
    if not path.exists():
        pytest.fail(
            f"the scenario process died (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}"
        )
    out = json.loads(path.read_text())
    out["__log__"] = proc.stdout
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_scenarios("orbax_scenarios.py", SCENARIOS, tmp_path_factory.mktemp("orbax"))


@pytest.fixture(scope="module")
def dtype_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_scenarios(
        "orbax_dtype_scenarios.py", DTYPE_SCENARIOS, tmp_path_factory.mktemp("orbax_dtypes")
    )


def _check(results: dict[str, Any], name: str) -> None:
    verdict = results.get(name)
    if verdict is None:
        pytest.fail(
            f"scenario {name} did not run (an earlier one crashed the process?):\n{results['__log__']}"
        )
    if verdict != "ok":
        pytest.fail(f"scenario {name} failed:\n{verdict}")


def test_save_4x2_restore_2x4_and_one_device_bit_exact(results):
    """bfloat16, float8, int8, typed and raw PRNG keys, numpy, values, NamedTuple and dataclass nodes;
    async and sync managers; one replica of each shard written; Restore() and item_metadata."""
    _check(results, "reshard_bitexact")


def test_composite_with_json_resumes_the_same_loss_sequence(results):
    """Train state + PRNG key (ckptio) and data-iterator position + step (JsonSave) in a Composite."""
    _check(results, "composite_resume")


def test_type_handler_routes_standard_and_pytree_save_through_ckptio(results):
    """register(): distinct typestr, no TensorStore array data, resharding, Orbax-written checkpoints
    still restore through the fallback, unregister()."""
    _check(results, "type_handler")


def test_retention_local_keeps_exactly_the_kept_steps_bytes(results):
    """10 saves: max_to_keep=2 -> 2 checkpoints' bytes; keep_period=4 -> 4; background delete too."""
    _check(results, "retention_local")


def test_retention_on_gcs_keeps_exactly_two_checkpoints_objects(results):
    """The same on gs:// (fake-gcs-server): 10 saves, max_to_keep=2 -> the bucket holds exactly the
    two kept steps' objects; restore of the last is bit-exact; delete() removes a step's objects."""
    _check(results, "retention_gcs")


def test_retention_hashed_external_storage_leaks_nothing(results):
    """mem:// with hashed naming (objects outside the step directory): the attached deleter removes
    each deleted step's objects at once; a plain manager's orphan sweep catches up by close()."""
    _check(results, "retention_hashed_mem")


def test_edge_cases(results):
    """Bare-array and empty-container states, bad leaves refused before Orbax starts, missing items,
    a stale external checkpoint replaced on re-save, a malformed pointer refused."""
    _check(results, "edge_cases")


def test_numpy_int64_leaves_restore_as_numpy_int64_with_x64_off(dtype_results):
    """Issue 20 #1: numpy int64/uint64/float64 leaves beyond 32 bits, Restore(ShapeDtypeStruct(sharding=None))
    -> np.ndarray in the saved dtype (was: a jax int32 array, values wrapped); onto devices -> ValueError
    naming the item; values 32 bits hold -> narrowed exactly; explicit casts checked."""
    _check(dtype_results, "numpy_int64_x64_off")


def test_jax_int64_leaves_x64_on_and_off(dtype_results):
    """jax 64-bit leaves saved with x64 on: exact with x64 on (also a caller-thread enable_x64 context);
    with x64 off a jax target raises naming the item, a numpy target restores exactly."""
    _check(dtype_results, "jax_int64_save_restore")


def test_type_handler_int64_x64_on_and_off(dtype_results):
    """register(): the same through StandardSave/PyTreeSave, numpy targets of ckptio-written leaves, and
    enable_x64 contexts reaching the restore thread."""
    _check(dtype_results, "type_handler_int64")


def test_type_handler_cast_save_and_restore_args_dtype(dtype_results):
    """Issue 20 #2: register() + SaveArgs.dtype / RestoreArgs.dtype on leaves of different meshes, also
    inside a jax.set_mesh context (a jitted astype failed there: the cast now runs on host buffers);
    a cast that cannot hold the values raises naming the item, on save and on restore."""
    _check(dtype_results, "type_handler_cast")


def test_property_any_dtype_restores_as_saved_under_every_target_form(dtype_results):
    """Hypothesis: every dtype (bool, ints, uints, float16/bf16/32/64, complex, float8, int4), numpy and jax
    leaves, scalar and zero-size shapes, x64 on and off, targets None / ShapeDtypeStruct with and without
    sharding / np.ndarray / jax.Array: same dtype and bits, or jax's narrower dtype with every value
    intact, or a ValueError naming the item."""
    _check(dtype_results, "property_save_restore")


def test_property_type_handler_any_dtype(dtype_results):
    """The same property for register() (StandardSave / StandardRestore target forms), zero-size
    arrays included: ckptio keeps accepting them where stock Orbax refuses (README, Orbax section)."""
    _check(dtype_results, "property_type_handler")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_jax_distributed_processes_save_and_restore(tmp_path):
    """Each process writes only its own shards (replicas once), process 0 commits; restored onto
    another mesh; Orbax's retention on the primary host; StandardSave through the TypeHandler."""
    port, root = _free_port(), str(tmp_path / "ckpt")
    procs = [
        subprocess.Popen(
            [sys.executable, str(paths.WORKERS / "orbax_mp_worker.py"), str(i), "2", str(port), root],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(i, p.returncode, o) for i, (p, o) in enumerate(zip(procs, outs)) if p.returncode]
    assert not failed, "\n\n".join(f"process {i} exited {rc}:\n{o[-4000:]}" for i, rc, o in failed)
    assert all(f"process {i}: ok" in o for i, o in enumerate(outs))


def test_register_twice_and_unregister_print_no_orbax_warning() -> None:
    """#36: register() replaced Orbax's handlers with two absl warnings at every call."""
    code = (
        "import jax, numpy as np\n"
        "from orbax.checkpoint import type_handlers as types\n"
        "import ckptio.orbax as co\n"
        "stock = types.get_type_handler(jax.Array)\n"
        "co.register(); co.register()\n"
        "assert isinstance(types.get_type_handler(jax.Array), co.CkptioArrayHandler)\n"
        "co.unregister()\n"
        "assert types.get_type_handler(jax.Array) is stock\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "overriding" not in out.stderr, out.stderr
