"""ckptio.orbax scenarios on 8 CPU devices, run in a subprocess by tests/orbax/test_orbax.py.

Usage: ``orbax_scenarios.py <workdir> [scenario ...]``. Each scenario runs in
turn; ``<workdir>/results.json`` maps its name to ``"ok"`` or the traceback.
A separate process, because 8 host devices must be set before jax is
imported, and other test files import jax with 1 device.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "support"))  # hosts

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from hosts import on_hosts  # noqa: E402
from jax.sharding import NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptio  # noqa: E402
import ckptio.orbax  # noqa: E402
from ckptio.backends import open_backend  # noqa: E402
from ckptio.backends.memory import MemoryBackend  # noqa: E402
from ckptio.engine import run_sync  # noqa: E402
from ckptio.engine.layout import HashedNaming  # noqa: E402
from ckptio.manifest import (  # noqa: E402
    FRAGMENT_PREFIX,  # noqa: E402
    MANIFEST_NAME,
    Manifest,
)
from ckptio.manifest.names import is_fencing  # noqa: E402

WORK = sys.argv[1]
SCENARIOS: dict[str, Callable[[str], None]] = {}


def scenario(fn: Callable[[str], None]) -> Callable[[str], None]:
    SCENARIOS[fn.__name__] = fn
    return fn


class Opt(NamedTuple):
    mu: Any
    count: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt: Opt
    step: Any


def mesh_4x2() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("x", "y"))


def mesh_2x4() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("x", "y"))


def bits(x: Any) -> tuple[str, bytes]:
    """dtype and raw bytes of a leaf (typed PRNG keys by their key data)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return str(a.dtype), a.tobytes()


def assert_tree_bits_equal(got: Any, want: Any, what: str) -> None:
    g, gt = jax.tree_util.tree_flatten_with_path(got)
    w, wt = jax.tree_util.tree_flatten_with_path(want)
    assert gt == wt, f"{what}: tree structure differs:\n{gt}\n{wt}"
    for (path, a), (_, b) in zip(g, w):
        if isinstance(b, (jax.Array, np.ndarray, np.generic)):
            assert bits(a) == bits(b), f"{what}: {jax.tree_util.keystr(path)} differs"
        else:
            assert type(a) is type(b) and a == b, f"{what}: {jax.tree_util.keystr(path)}: {a!r} != {b!r}"


def array_nbytes(tree: Any) -> int:
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            total += np.asarray(x).nbytes
    return total


def rand_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def put(x: np.ndarray, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    return jax.device_put(x, NamedSharding(mesh, spec))


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    m = mesh_4x2()
    return {
        "bf16": put(rand_bits(rng, (64, 32), ml_dtypes.bfloat16), m, P("x", "y")),
        "f32": put(rand_bits(rng, (32, 16), np.float32), m, P("x", "y")),
        "f8": put(rand_bits(rng, (8, 8), ml_dtypes.float8_e4m3fn), m, P("x", "y")),
        "i8": put(rand_bits(rng, (16,), np.int8), m, P("x")),  # replicated over y: written once
        "repl": put(rand_bits(rng, (5, 3), np.float32), m, P()),
        "scalar": put(np.float32(1.5), m, P()),
        "key": jax.random.key(3),
        "raw_key": jax.random.PRNGKey(4),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "py": [7, 2.5, "s", True, b"\x00"],
        "opt": Opt(mu=put(rand_bits(rng, (8, 4), ml_dtypes.bfloat16), m, P("x")), count=jnp.int32(3)),
        "ts": TrainState(
            params={"w": put(rand_bits(rng, (8, 8), np.float32), m, P(None, "y"))},
            opt=Opt(mu=np.zeros(2, np.float32), count=0),
            step=5,
        ),
    }


def abstract_on(state: Any, sharding_for: Callable[[jax.Array], Any]) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x))
        return x

    return jax.tree_util.tree_map(leaf, state)


def transposed(x: jax.Array) -> Any:
    """2x4 mesh, P('y','x') for matrices, P('y') for vectors (each axis only where it divides)."""
    mesh = mesh_2x4()
    axes = [a for a, n in zip(("y", "x"), x.shape) if n % mesh.shape[a] == 0 and n > 0]
    spec = [a if i < len(axes) and a == axes[i] else None for i, a in enumerate(("y", "x")[: x.ndim])]
    return NamedSharding(mesh, P(*spec))


def object_bytes(item_dir: str) -> int:
    with open(os.path.join(item_dir, MANIFEST_NAME), "rb") as f:
        m = Manifest.from_json(f.read(), item_dir)
    return sum(os.path.getsize(os.path.join(item_dir, k)) for k in m.objects)


# -- scenarios ---------------------------------------------------------------


@scenario
def reshard_bitexact(root: str) -> None:
    state = make_state()
    for mode, async_ in (("async", True), ("sync", False)):
        path = os.path.join(root, mode)
        opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_)
        with ocp.CheckpointManager(path, options=opts) as mngr:
            mngr.save(1, args=ckptio.orbax.Save(state))
            state["np"][0, 0] = 99  # staged copies: mutating after save() returns changes nothing saved
            mngr.wait_until_finished()
            state["np"][0, 0] = 0
            # Only one replica of each shard is written: the objects hold each array exactly once.
            assert object_bytes(os.path.join(path, "1", "default")) == array_nbytes(state), mode
            out = mngr.restore(1, args=ckptio.orbax.Restore(abstract_on(state, transposed)))
            assert_tree_bits_equal(out, state, f"{mode}: 2x4 P('y','x')")
            assert out["bf16"].sharding == transposed(state["bf16"]) and isinstance(out["ts"], TrainState)
            one = SingleDeviceSharding(jax.devices()[5])
            out = mngr.restore(1, args=ckptio.orbax.Restore(abstract_on(state, lambda x, one=one: one)))
            assert_tree_bits_equal(out, state, f"{mode}: one device")
            assert out["f32"].sharding == one and out["key"].dtype == state["key"].dtype
            plain = mngr.restore(1, args=ckptio.orbax.Restore())
            assert bits(plain["ts"]["params"]["w"]) == bits(state["ts"].params["w"])
            assert plain["opt"]["mu"].dtype == ml_dtypes.bfloat16 and plain["py"]["2"] == "s"
            meta = mngr.item_metadata(1)
            assert meta["bf16"].shape == (64, 32) and meta["bf16"].dtype == ml_dtypes.bfloat16


def _linear_data(n: int = 512) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = (x @ rng.standard_normal((8, 4)) + 0.1).astype(np.float32)
    return x, y


def _loss(params: Any, xb: jax.Array, yb: jax.Array, k: jax.Array) -> jax.Array:
    mask = jax.random.bernoulli(k, 0.8, xb.shape).astype(xb.dtype)  # dropout: consumes the PRNG key
    pred = (xb * mask) @ params["w"] + params["b"]
    return jnp.mean((pred - yb) ** 2)


@jax.jit  # module level: compiled once for every _train call
def _step(st: TrainState, xb: jax.Array, yb: jax.Array, k: jax.Array) -> tuple[TrainState, jax.Array]:
    loss, g = jax.value_and_grad(_loss)(st.params, xb, yb, k)
    mu = jax.tree_util.tree_map(lambda mu, g: 0.9 * mu + g, st.opt.mu, g)
    params = jax.tree_util.tree_map(lambda p, mu: p - 0.05 * mu, st.params, mu)
    return TrainState(params, Opt(mu, st.opt.count + 1), st.step + 1), loss


def _train(
    state: TrainState, key: jax.Array, position: int, steps: int
) -> tuple[TrainState, jax.Array, int, list[float]]:
    """SGD with momentum and random dropout masks; the batch is chosen by the data iterator position."""
    x, y = _linear_data()
    m = mesh_4x2()
    losses = []
    for _ in range(steps):
        idx = (np.arange(32) + position * 32) % len(x)
        xb, yb = put(x[idx], m, P("x")), put(y[idx], m, P("x"))
        key, sub = jax.random.split(key)
        state, loss = _step(state, xb, yb, sub)
        position += 1
        losses.append(float(loss))
    return state, key, position, losses


@scenario
def composite_resume(root: str) -> None:
    m = mesh_4x2()
    params = {
        "w": put(np.zeros((8, 4), np.float32), m, P(None, "y")),
        "b": put(np.zeros(4, np.float32), m, P()),
    }
    state = TrainState(
        params, Opt(jax.tree_util.tree_map(jnp.zeros_like, params), jnp.int32(0)), jnp.int32(0)
    )
    key, position = jax.random.key(42), 0
    losses: list[float] = []
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(root, options=opts) as mngr:
        for _ in range(4):  # saves at steps 3, 6, 9, 12
            state, key, position, ls = _train(state, key, position, 3)
            losses += ls
            step = int(state.step)
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ckptio.orbax.Save({"train": state, "key": key}),
                    data=ocp.args.JsonSave({"position": position, "step": step}),
                ),
            )
        state, key, position, ls = _train(state, key, position, 6)
        losses += ls
        assert mngr.all_steps() == [9, 12], mngr.all_steps()

    # A new process would do this: find the latest step, restore onto an abstract state, go on.
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), {"train": state}
    )
    # The key goes where the step's other inputs are (a restored array is committed to its devices).
    abstract["key"] = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(m, P()))
    with ocp.CheckpointManager(root, options=opts) as mngr:
        step = mngr.latest_step()
        got = mngr.restore(
            step, args=ocp.args.Composite(state=ckptio.orbax.Restore(abstract), data=ocp.args.JsonRestore())
        )
    assert got.data == {"position": 12, "step": 12}, got.data
    st2, key2 = got.state["train"], got.state["key"]
    assert isinstance(st2, TrainState) and int(st2.step) == 12
    _, _, _, resumed = _train(st2, key2, got.data["position"], 6)
    assert resumed == losses[12:], f"resumed losses differ:\n{resumed}\n{losses[12:]}"


def assert_only_marker_in_ocdbt(item: str, leaves: set[str]) -> None:
    """The item's OCDBT database holds ckptio's stock-Orbax marker for ``leaves`` and nothing else."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    from ckptio.orbax._marker import marker_entries

    spec = ts_utils.build_kvstore_tspec(item, use_ocdbt=True)
    kv = ts.KvStore.open(spec, context=ts_utils.get_ts_context(use_ocdbt=True)).result()
    got = {k.decode(): kv.read(k).result().value for k in kv.list().result()}
    assert got == marker_entries(sorted(leaves), use_zarr3=False), sorted(got)


@scenario
def type_handler(root: str) -> None:
    state = {k: v for k, v in make_state().items() if isinstance(v, jax.Array)}
    stock_dir, our_dir = os.path.join(root, "stock"), os.path.join(root, "ckptio")
    with ocp.CheckpointManager(stock_dir) as mngr:  # Orbax's own ArrayHandler, before register()
        mngr.save(1, args=ocp.args.StandardSave(state))
    handler = ckptio.orbax.register()
    try:
        assert ocp.type_handlers.get_type_handler(jax.Array) is handler
        with ocp.CheckpointManager(our_dir + "_pytree") as mngr:
            mngr.save(2, args=ocp.args.PyTreeSave(state))
            out = mngr.restore(2, args=ocp.args.PyTreeRestore(abstract_on(state, transposed)))
            assert_tree_bits_equal(out, state, "PyTreeSave: 2x4 P('y','x')")
        with ocp.CheckpointManager(our_dir) as mngr:
            mngr.save(1, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
            item = os.path.join(our_dir, "1", "default")
            with open(os.path.join(item, "_METADATA")) as f:
                types = {v["value_metadata"]["value_type"] for v in json.load(f)["tree_metadata"].values()}
            assert types == {ckptio.orbax.TYPESTR}, types
            # No TensorStore array data: every byte went through ckptio. Orbax's OCDBT database
            # holds only ckptio's marker (a .zarray naming register() and an empty chunk per leaf).
            assert_only_marker_in_ocdbt(item, set(state))
            assert os.path.isdir(os.path.join(item, "ckptio"))
            out = mngr.restore(1, args=ocp.args.StandardRestore(abstract_on(state, transposed)))
            assert_tree_bits_equal(out, state, "StandardSave: 2x4 P('y','x')")
            one = SingleDeviceSharding(jax.devices()[2])
            out = mngr.restore(1, args=ocp.args.StandardRestore(abstract_on(state, lambda x: one)))
            assert_tree_bits_equal(out, state, "type handler: one device")
            assert out["bf16"].sharding == one
            out = mngr.restore(1, args=ocp.args.StandardRestore())  # the saved shardings
            assert out["bf16"].sharding.spec == P("x", "y")
        with ocp.CheckpointManager(stock_dir) as mngr:  # still readable: the fallback handler
            out = mngr.restore(1, args=ocp.args.StandardRestore(abstract_on(state, transposed)))
            assert_tree_bits_equal(out, state, "stock checkpoint read through the fallback")
    finally:
        ckptio.orbax.unregister()
    assert not isinstance(ocp.type_handlers.get_type_handler(jax.Array), ckptio.orbax.CkptioArrayHandler)


def small_state(i: int) -> dict[str, Any]:
    m = mesh_4x2()
    return {
        "w": put(np.full((64, 32), i, np.float32), m, P("x", "y")),
        "b": put(np.full(32, i, ml_dtypes.bfloat16), m, P("y")),
        "step": i,
    }


def local_ckptio_files(root: str) -> dict[str, int]:
    """Every ckptio file under the Orbax root (manifests and objects), path -> size."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f == MANIFEST_NAME or ".h0" in f:
                out[os.path.join(d, f)] = os.path.getsize(os.path.join(d, f))
    return out


@scenario
def retention_local(root: str) -> None:
    one = array_nbytes(small_state(0))
    for name, opts, kept in (
        ("max2", ocp.CheckpointManagerOptions(max_to_keep=2), [8, 9]),
        ("period4", ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=4), [0, 4, 8, 9]),
        ("background", ocp.CheckpointManagerOptions(max_to_keep=2, enable_background_delete=True), [8, 9]),
    ):
        path = os.path.join(root, name)
        with ocp.CheckpointManager(path, options=opts) as mngr:
            for i in range(10):
                mngr.save(i, args=ckptio.orbax.Save(small_state(i)))
        with ocp.CheckpointManager(path, options=opts) as mngr:
            assert mngr.all_steps() == kept, (name, mngr.all_steps())
        files = local_ckptio_files(path)
        manifests = sorted(p for p in files if p.endswith(MANIFEST_NAME))
        assert len(manifests) == len(kept), (name, manifests)
        data = sum(n for p, n in files.items() if not p.endswith(MANIFEST_NAME))
        assert data == len(kept) * one, (name, data, one)
        leftovers = sorted(set(os.listdir(path)) - {str(s) for s in kept})
        assert not leftovers, (name, leftovers)


def mem_usage(url: str) -> tuple[int, int, list[str]]:
    """(object bytes, manifests, keys) held by a memory 'bucket' (or any storage URL)."""
    backend = MemoryBackend(url) if url.startswith("mem://") else open_backend(url)

    async def listing() -> list[Any]:
        try:
            return await backend.list("")
        finally:
            await backend.close()

    infos = [i for i in run_sync(listing()) if not is_fencing(i.key)]  # commit bookkeeping: not data
    manifests = [i.key for i in infos if i.key.endswith(MANIFEST_NAME)]
    data = sum(i.size for i in infos if not i.key.endswith(MANIFEST_NAME))
    return data, len(manifests), [i.key for i in infos]


@scenario
def retention_hashed_mem(root: str) -> None:
    one = array_nbytes(small_state(0))
    # ckptio.orbax.CheckpointManager: its deleter removes the external data with each step, at once.
    for name, opts, kept in (
        ("max2", ocp.CheckpointManagerOptions(max_to_keep=2), [8, 9]),
        ("period4", ocp.CheckpointManagerOptions(max_to_keep=2, keep_period=4), [0, 4, 8, 9]),
        ("background", ocp.CheckpointManagerOptions(max_to_keep=2, enable_background_delete=True), [8, 9]),
    ):
        storage = f"mem://orbax-retention-{name}"
        with ckptio.orbax.CheckpointManager(
            os.path.join(root, name), opts, storage=storage, naming=HashedNaming()
        ) as mngr:
            for i in range(10):
                mngr.save(
                    i,
                    args=ocp.args.Composite(
                        state=ckptio.orbax.Save(small_state(i)), meta=ocp.args.JsonSave({"i": i})
                    ),
                )
                mngr.wait_until_finished()
                if name == "max2":
                    data, manifests, keys = mem_usage(f"{storage}/state")
                    assert (data, manifests) == (min(i + 1, 2) * one, min(i + 1, 2)), (
                        i,
                        data,
                        manifests,
                        keys,
                    )
                    assert all(k.startswith("h") for k in keys if not k.endswith(MANIFEST_NAME)), keys
            assert mngr.all_steps() == kept, (name, mngr.all_steps())
            got = mngr.restore(9, args=ocp.args.Composite(state=ckptio.orbax.Restore(small_state(0))))
            assert_tree_bits_equal(got.state, small_state(9), f"{name}: restore from external storage")
            item = os.path.join(root, name, "9", "state")
            assert not any(".h0" in f for f in os.listdir(item)), os.listdir(item)  # data is outside
        data, manifests, _ = mem_usage(f"{storage}/state")
        assert (data, manifests) == (len(kept) * one, len(kept)), (name, data, manifests)
        with ckptio.orbax.CheckpointManager(os.path.join(root, name), opts, storage=storage) as mngr:
            mngr.delete(kept[0])  # an explicit delete goes through the same deleter
        assert mem_usage(f"{storage}/state")[:2] == ((len(kept) - 1) * one, len(kept) - 1), name

    # Any ocp.CheckpointManager with a registry: the handler's orphan sweep after each save lags
    # one save behind Orbax's retention (which runs after finalize); close() catches up.
    storage = "mem://orbax-retention-sweep"
    path = os.path.join(root, "sweep")
    # A committed leftover of this run whose Orbax step is gone (e.g. a crash between the commits),
    # and a checkpoint of another run sharing the storage root: the sweep deletes only the first.
    owned = {"ckptio.orbax": {"orbax_root": path}}
    ckptio.save(f"{storage}/state", small_state(77), 77, metadata=owned, naming=HashedNaming()).result()
    foreign = {"ckptio.orbax": {"orbax_root": path + "-other-run"}}
    ckptio.save(f"{storage}/state", small_state(88), 88, metadata=foreign, naming=HashedNaming()).result()
    # A two-host (format 2) leftover of this run with a damaged fragment: ownership is in the root
    # manifest, so the sweep deletes it (a fragment it need not read must not pin it forever).
    rows = np.arange(64, dtype=np.float32).reshape(8, 8)
    on_hosts(2, lambda rank, coord: ckptio.save(
        f"{storage}/state", {"w": ckptio.Sharded(rows.shape, rows.dtype, [((slice(4 * rank, 4 * rank + 4),),
                                                                             rows[4 * rank:4 * rank + 4])])},
        66, metadata=owned, naming=HashedNaming(), coordinator=coord).result())
    bucket = MemoryBackend(f"{storage}/state")
    fragments = [i.key for i in run_sync(bucket.list("66/")) if FRAGMENT_PREFIX in i.key]
    assert len(fragments) == 2, fragments
    damaged = bytearray(run_sync(bucket.read(fragments[0])))
    damaged[len(damaged) // 2] ^= 0xFF
    run_sync(bucket.write(fragments[0], [memoryview(bytes(damaged))]))
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(
        path, options=opts, handler_registry=ckptio.orbax.handler_registry(storage, naming=HashedNaming())
    ) as mngr:
        for i in range(10):
            mngr.save(i, args=ocp.args.Composite(state=ckptio.orbax.Save(small_state(i))))
            mngr.wait_until_finished()
            data, manifests, _ = mem_usage(f"{storage}/state")
            assert manifests <= 4 and data == manifests * one, (i, data, manifests, one, mem_usage(f"{storage}/state")[2])
    data, manifests, keys = mem_usage(f"{storage}/state")
    assert (data, manifests) == (3 * one, 3), keys  # steps 8, 9 and the other run's 88
    assert "88/" + MANIFEST_NAME in keys and "77/" + MANIFEST_NAME not in keys, keys
    assert not any(k.startswith("66/") for k in keys), keys

    # The orphan sweep lists the whole storage root: it runs at the first save, then once per
    # sweep_interval_seconds, and on close -- while every save still deletes what retention dropped.
    full_sweeps: list[str] = []
    real_sweep = ckptio.store.CheckpointStore.sweep

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        full_sweeps.append(self.url)
        return await real_sweep(self, *args, **kwargs)

    ckptio.store.CheckpointStore.sweep = counted  # type: ignore[method-assign]
    try:
        for interval, during in ((600.0, 1), (0.0, 6)):
            storage = f"mem://orbax-sweep-interval-{int(interval)}"
            registry = ckptio.orbax.handler_registry(storage, naming=HashedNaming(), sweep_interval_seconds=interval)
            full_sweeps.clear()
            with ocp.CheckpointManager(os.path.join(root, f"interval-{int(interval)}"), options=opts,
                                       handler_registry=registry) as mngr:
                for i in range(6):
                    mngr.save(i, args=ocp.args.Composite(state=ckptio.orbax.Save(small_state(i))))
                    mngr.wait_until_finished()
                    data, manifests, _ = mem_usage(f"{storage}/state")
                    assert manifests <= 3 and data == manifests * one, (interval, i, data, manifests)
                assert len(full_sweeps) == during, (interval, full_sweeps)
            assert len(full_sweeps) == during + 1, (interval, full_sweeps)  # and one more on close
            assert mem_usage(f"{storage}/state")[:2] == (2 * one, 2), interval
    finally:
        ckptio.store.CheckpointStore.sweep = real_sweep  # type: ignore[method-assign]

@scenario
def retention_gcs(root: str) -> None:
    """max_to_keep=2 with the data on gs:// (fake-gcs-server; hashed names are the default there)."""
    from ckptio.bench.fakegcs import FakeGCS

    one = array_nbytes(small_state(0))
    with FakeGCS() as server:
        server.create_bucket("orbax-retention")
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        try:
            storage = "gs://orbax-retention/run"
            opts = ocp.CheckpointManagerOptions(max_to_keep=2)
            with ckptio.orbax.CheckpointManager(os.path.join(root, "gcs"), opts, storage=storage) as mngr:
                for i in range(10):
                    mngr.save(i, args=ocp.args.Composite(state=ckptio.orbax.Save(small_state(i))))
                    mngr.wait_until_finished()
                    data, manifests, keys = mem_usage(f"{storage}/state")
                    assert (data, manifests) == (min(i + 1, 2) * one, min(i + 1, 2)), (i, data, manifests, keys)
                    assert all(k.startswith("h") for k in keys if not k.endswith(MANIFEST_NAME)), keys
                assert mngr.all_steps() == [8, 9], mngr.all_steps()
                got = mngr.restore(9, args=ocp.args.Composite(state=ckptio.orbax.Restore(small_state(0))))
                assert_tree_bits_equal(got.state, small_state(9), "restore from gs://")
                mngr.delete(8)
            assert mem_usage(f"{storage}/state")[:2] == (one, 1)
        finally:
            del os.environ["STORAGE_EMULATOR_HOST"]


@scenario
def edge_cases(root: str) -> None:
    from ckptio.errors import CheckpointNotFoundError, UnsupportedLeafError

    with ocp.CheckpointManager(os.path.join(root, "edge")) as mngr:
        # A bare array is a valid state; so is a tree with empty containers.
        x = put(np.arange(16, dtype=np.float32).reshape(4, 4), mesh_4x2(), P("x"))
        mngr.save(1, args=ckptio.orbax.Save(x))
        mngr.save(2, args=ckptio.orbax.Save({"a": x, "empty": {}, "none": None, "t": ()}))
        mngr.wait_until_finished()
        assert bits(mngr.restore(1, args=ckptio.orbax.Restore(abstract_on(x, transposed)))) == bits(x)
        out = mngr.restore(2, args=ckptio.orbax.Restore({"a": x, "empty": {}, "none": None, "t": ()}))
        assert out["empty"] == {} and out["none"] is None and out["t"] == () and bits(out["a"]) == bits(x)
        for bad, where in (
            ({"ok": 1, "o": [0, object()]}, "o/1: cannot save"),
            ({"a": np.array([None])}, "a: dtype object"),
        ):
            try:
                ckptio.orbax.Save(bad)  # refused before Orbax starts a save
            except UnsupportedLeafError as e:
                assert where in str(e), e
            else:
                raise AssertionError(f"saving {bad} did not fail")
        mngr.save(3, args=ckptio.orbax.Save({"after": 1}))  # and the manager is fine afterwards
        mngr.wait_until_finished()
        assert mngr.restore(3, args=ckptio.orbax.Restore()) == {"after": 1}
        try:
            mngr.restore(2, args=ckptio.orbax.Restore({"a": x, "missing": x}))
        except KeyError as e:
            assert "missing" in str(e), e
        else:
            raise AssertionError("restoring a missing item did not fail")

    # External storage: a committed ckptio checkpoint for a step whose Orbax save never finished
    # (crash between the two commits) is replaced when the step is saved again.
    storage = "mem://orbax-edge"
    owned = {"ckptio.orbax": {"orbax_root": os.path.join(root, "stale")}}
    ckptio.save(f"{storage}/state", small_state(50), 5, metadata=owned, naming=HashedNaming()).result()
    with ckptio.orbax.CheckpointManager(
        os.path.join(root, "stale"), storage=storage, naming=HashedNaming()
    ) as mngr:
        mngr.save(5, args=ocp.args.Composite(state=ckptio.orbax.Save(small_state(5))))
        mngr.wait_until_finished()
        got = mngr.restore(5, args=ocp.args.Composite(state=ckptio.orbax.Restore(small_state(0))))
        assert_tree_bits_equal(got.state, small_state(5), "re-saved step")

        # Another run (another Orbax directory) given the same storage root must not clobber step 5.
        with ckptio.orbax.CheckpointManager(os.path.join(root, "other"), storage=storage) as other:
            other.save(5, args=ocp.args.Composite(state=ckptio.orbax.Save(small_state(6))))
            try:
                other.wait_until_finished()
            except Exception as e:
                assert "its own storage root" in str(e), e
            else:
                raise AssertionError("a second run overwrote the first one's checkpoint")
        assert mem_usage(f"{storage}/state")[:2] == (array_nbytes(small_state(0)), 1)

        pointer = os.path.join(root, "stale", "5", "state", ckptio.orbax.POINTER_NAME)
        with open(pointer, "w") as f:
            f.write('{"format": "something else"}')
        try:
            mngr.restore(5, args=ocp.args.Composite(state=ckptio.orbax.Restore(small_state(0))))
        except CheckpointNotFoundError as e:
            assert ckptio.orbax.POINTER_NAME in str(e), e
        else:
            raise AssertionError("a bad pointer was followed")
    # The sweep on close met the malformed pointer: it kept everything rather than guess.
    assert mem_usage(f"{storage}/state")[:2] == (array_nbytes(small_state(0)), 1)



def main() -> None:
    names = sys.argv[2:] or list(SCENARIOS)
    results: dict[str, Any] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            SCENARIOS[name](os.path.join(WORK, name))
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
        print(
            f"{name}: {'ok' if results[name] == 'ok' else 'FAILED'} ({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        with open(os.path.join(WORK, "results.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
