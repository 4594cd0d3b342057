"""One of two jax.distributed processes on CPU (4 devices each) saving and restoring through ckptio.orbax.

Usage: ``orbax_mp_worker.py <process_id> <num_processes> <coordinator_port> <root>``.
Run by tests/orbax/test_orbax.py; exits non-zero with a traceback on any mismatch.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

pid, nproc, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptio.orbax  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402
from ckptio.engine.layout import HashedNaming  # noqa: E402
from ckptio.manifest import MANIFEST_NAME  # noqa: E402
from ckptio.store import CheckpointStore  # noqa: E402


def global_values() -> dict[str, np.ndarray]:
    """The same arrays on every process (deterministic), as host numpy."""
    rng = np.random.default_rng(7)
    return {
        "w": rng.integers(0, 1 << 16, size=(16, 8), dtype=np.uint16).view(ml_dtypes.bfloat16),
        "b": rng.standard_normal(24).astype(np.float32),
        "r": rng.integers(-100, 100, size=(4, 4), dtype=np.int32),  # fully replicated
    }


def make(values: dict[str, np.ndarray], shardings: dict[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
    # Each process supplies only its addressable slices, as a real multi-host job does.
    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in values.items()
    }


def check(restored: dict[str, jax.Array], values: dict[str, np.ndarray], what: str) -> None:
    for k, v in values.items():
        arr = restored[k]
        for shard in arr.addressable_shards:
            got = np.asarray(shard.data)
            want = v[shard.index]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (
                f"{what}: {k} {shard.index} differs"
            )


def main() -> None:
    assert jax.process_count() == nproc and jax.device_count() == 4 * nproc
    values = global_values()
    mesh = jax.make_mesh((4, 2), ("x", "y"))  # spans both processes
    saved = {
        "w": NamedSharding(mesh, P("x", "y")),
        "b": NamedSharding(mesh, P(("x", "y"))),
        "r": NamedSharding(mesh, P()),
    }
    state = {**make(values, saved), "step": 11}

    mngr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=1))
    mngr.save(1, args=ckptio.orbax.Save(state))
    mngr.save(2, args=ckptio.orbax.Save(state))  # retention deletes step 1 on the primary host
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2], mngr.all_steps()

    # Each host wrote its own shards, one replica each: the objects hold each array's bytes once.
    item = os.path.join(root, "2", "default")
    # Format 2 (several hosts): a root and one fragment per host; the store loads them all.
    manifest = run_sync(CheckpointStore(item).read_manifest(""))
    hosts = {s.host for name in ("w", "b") for s in manifest.items[name].shards}
    assert hosts == set(range(nproc)), hosts
    assert {s.host for s in manifest.items["r"].shards} == {0}
    obj_bytes = sum(os.path.getsize(os.path.join(item, k)) for k in manifest.objects)
    assert obj_bytes == sum(v.nbytes for v in values.values()), (
        obj_bytes,
        [v.nbytes for v in values.values()],
    )

    # Restore onto another mesh and sharding (P('y','x') on 2x4), and fully replicated.
    mesh2 = jax.make_mesh((2, 4), ("x", "y"))
    target = {
        "w": jax.ShapeDtypeStruct((16, 8), ml_dtypes.bfloat16, sharding=NamedSharding(mesh2, P("y", "x"))),
        "b": jax.ShapeDtypeStruct((24,), np.float32, sharding=NamedSharding(mesh2, P("y"))),
        "r": jax.ShapeDtypeStruct((4, 4), np.int32, sharding=NamedSharding(mesh2, P(None, "x"))),
        "step": 0,
    }
    out = mngr.restore(2, args=ckptio.orbax.Restore(target))
    check(out, values, "2x4 P('y','x')")
    assert out["step"] == 11 and out["w"].sharding == target["w"].sharding
    repl = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh2, P()))
        for k, v in values.items()
    }
    check(mngr.restore(2, args=ckptio.orbax.Restore(repl)), values, "replicated")

    # Orbax's own StandardSave with jax.Array leaves routed through ckptio.
    mngr.close()

    # External storage shared by both processes (a local directory standing in for a bucket),
    # hashed names: each host writes there, process 0 writes the pointer and commits; retention
    # on the primary host deletes the data of step 1.
    ext = root + "_external"
    opts = ocp.CheckpointManagerOptions(max_to_keep=1)
    with ckptio.orbax.CheckpointManager(root + "_orbax", opts, storage=ext, naming=HashedNaming()) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.Composite(state=ckptio.orbax.Save(state)))
        mngr.wait_until_finished()
        out = mngr.restore(2, args=ocp.args.Composite(state=ckptio.orbax.Restore(target))).state
        check(out, values, "external storage")
    if pid == 0:
        files = [os.path.join(d, f) for d, _, fs in os.walk(ext) for f in fs]
        data = sum(os.path.getsize(f) for f in files  # data objects only: not the root, fragments or fence
                   if not f.endswith(MANIFEST_NAME) and "ckptio.fragment." not in f and "ckptio.fence." not in f)
        assert data == sum(v.nbytes for v in values.values()), (data, files)
        assert [f for f in files if f.endswith(MANIFEST_NAME)] == [os.path.join(ext, "state", "2", MANIFEST_NAME)]

    ckptio.orbax.register()
    with ocp.CheckpointManager(root + "_standard") as std:
        std.save(3, args=ocp.args.StandardSave(make(values, saved)))
        std.wait_until_finished()
        abstract = {k: target[k] for k in values}
        check(std.restore(3, args=ocp.args.StandardRestore(abstract)), values, "type handler")
    print(f"process {pid}: ok", flush=True)


if __name__ == "__main__":
    main()
