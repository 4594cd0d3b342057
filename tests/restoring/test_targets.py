"""``ckptio.restore_target``: a restore target from a live state, and Python scalars in targets.

A fresh flax ``TrainState`` (its ``step`` a Python int) restores bit-exact
through the helper on an 8-device CPU mesh, onto its own shardings or others
swapped in; a Python int / float / str leaf of a target restores the saved
value as that type, and an incompatible one is refused naming its path;
torch state_dicts and numpy-only states get targets that allocate nothing.

The mesh tests need 8 CPU devices, which must be set before jax is first
used: with fewer, they run in one child process of this file (``python
tests/restoring/test_targets.py <workdir>``), as tests/orbax/test_orbax.py does.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest

import ckptio

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _bits(x: Any) -> bytes:
    """The bytes of an array leaf (typed keys as their key data), for bit-exact comparisons."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def _assert_same(back: Any, want: Any) -> None:
    """Same tree type and structure, every leaf of the same type and bits (Python scalars equal)."""
    assert jax.tree.structure(back) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array)), (a, b)
        if isinstance(b, (jax.Array, np.ndarray, np.generic)):
            assert a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
        else:
            assert a == b


# -- on an 8-device CPU mesh --------------------------------------------------------------------------


def _train_state(mesh: Any) -> Any:
    """A fresh flax TrainState with adam, its params sharded over ``mesh`` (its step the int 0)."""
    import optax
    from flax.training.train_state import TrainState
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params = {
        "dense": {"kernel": jax.device_put(jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7,
                                           NamedSharding(mesh, P("x", "y"))),
                  "bias": jax.device_put(jnp.linspace(-1, 1, 8, dtype=jnp.bfloat16), NamedSharding(mesh, P()))},
        "embed": jax.device_put(jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4), NamedSharding(mesh, P("x"))),
    }
    return TrainState.create(apply_fn=lambda p, x: x, params=params, tx=optax.adam(1e-3))


def _mesh() -> Any:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))


def mesh_fresh_train_state(tmp: Path) -> None:
    """The README's recipe on a fresh TrainState: step an int, optax's count a jax array."""
    state = _train_state(_mesh())
    assert type(state.step) is int
    ckptio.save(str(tmp), state, step=0).result()
    target = ckptio.restore_target(state)
    assert target.step == 0 and isinstance(target.params["dense"]["kernel"], jax.ShapeDtypeStruct)
    back = ckptio.restore(str(tmp), 0, target=target)
    assert type(back) is type(state) and back.tx is state.tx and back.apply_fn is state.apply_fn
    _assert_same(back, state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        if isinstance(b, jax.Array):
            assert a.sharding == b.sharding and a.committed == b.committed


def mesh_trained_state_into_a_fresh_target(tmp: Path) -> None:
    """A jitted step saves ``step`` as a jax array; the fresh state's int target gets it as an int."""
    state = _train_state(_mesh())
    grads = jax.tree.map(jnp.ones_like, state.params)
    train_step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    trained = train_step(train_step(state, grads), grads)
    assert isinstance(trained.step, jax.Array)
    ckptio.save(str(tmp), trained, step=2).result()
    target = ckptio.restore_target(state)
    back = ckptio.restore(str(tmp), 2, target=target)
    assert back.step == 2 and type(back.step) is int
    # The values are the trained state's; the shardings the target's (jit may have chosen others).
    for a, b, t in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(trained.opt_state),
                       jax.tree.leaves(target.opt_state)):
        assert _bits(a) == _bits(b)
        assert a.sharding == t.sharding if t.sharding is not None else not a.committed  # adam's count
    assert int(train_step(back, grads).step) == 3  # the restored state trains on


def mesh_resharded_target(tmp: Path) -> None:
    """The helper's output with other shardings swapped in restores onto those (a new mesh shape)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    state = _train_state(_mesh())
    ckptio.save(str(tmp), state, step=0).result()
    other = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

    def swap(x: Any) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x  # the int step
        spec = {2: P("a", "b"), 1: P("b"), 0: P()}[len(x.shape)]  # every dimension here divides evenly
        return x.update(sharding=NamedSharding(other, spec))

    target = jax.tree.map(swap, ckptio.restore_target(state))
    back = ckptio.restore(str(tmp), 0, target=target)
    _assert_same(back, state)
    for a, t in zip(jax.tree.leaves(back), jax.tree.leaves(target)):
        if isinstance(t, jax.ShapeDtypeStruct):
            assert a.sharding == t.sharding and a.sharding.mesh.devices.shape == (2, 4)


MESH_SCENARIOS: dict[str, Callable[[Path], None]] = {
    f.__name__: f for f in (mesh_fresh_train_state, mesh_trained_state_into_a_fresh_target, mesh_resharded_target)
}


def _run_here(work: Path) -> dict[str, str]:
    """Run every mesh scenario in this process: ``name -> "ok" or the traceback``."""
    out = {}
    for name, scenario in MESH_SCENARIOS.items():
        (work / name).mkdir(parents=True, exist_ok=True)
        try:
            scenario(work / name)
            out[name] = "ok"
        except BaseException:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def mesh_verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    work = tmp_path_factory.mktemp("mesh")
    if jax.device_count() >= 8:  # already run with 8 devices (XLA_FLAGS set for the whole suite)
        return _run_here(work)
    # Other test files have started jax with 1 device: 8 need a process of their own.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, str(work)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    results = work / "results.json"
    if not results.exists():
        pytest.fail(f"the 8-device process died (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-5000:]}")
    return json.loads(results.read_text())


@pytest.mark.parametrize("scenario", list(MESH_SCENARIOS))
def test_on_an_8_device_mesh(mesh_verdicts: dict[str, str], scenario: str) -> None:
    assert mesh_verdicts[scenario] == "ok", mesh_verdicts[scenario]


# -- Python scalars in a target -----------------------------------------------------------------------


def test_python_scalar_leaves_restore_the_saved_values_as_their_types(tmp_path: Path) -> None:
    state = {"step": 7, "lr": 0.5, "name": "run", "flag": True, "blob": b"\x00\xff", "nothing": None,
             "big": -(2**80), "w": np.arange(3.0)}
    ckptio.save(str(tmp_path), state, step=1).result()
    target = ckptio.restore_target(state)
    assert {k: target[k] for k in state if k != "w"} == {k: v for k, v in state.items() if k != "w"}
    back = ckptio.restore(str(tmp_path), 1, target=target)
    for k, v in state.items():
        if k == "w":
            np.testing.assert_array_equal(back[k], v)
        else:
            assert back[k] == v and type(back[k]) is type(v), k
    # The target's values are placeholders: the saved ones come back, whatever the target holds.
    back = ckptio.restore(str(tmp_path), 1, target={**state, "step": 0, "lr": 1.0, "name": "", "flag": False})
    assert (back["step"], back["lr"], back["name"], back["flag"]) == (7, 0.5, "run", True)


def test_python_scalar_targets_take_saved_0d_arrays_and_widen_exactly(tmp_path: Path) -> None:
    state = {"count": jnp.int32(5), "loss": np.float32(0.25), "bf": jnp.asarray(1.5, jnp.bfloat16),
             "ok": np.bool_(True), "i": 3, "tag": np.str_("abc")}
    ckptio.save(str(tmp_path), state, step=1).result()
    back = ckptio.restore(str(tmp_path), 1, target={"count": 0, "loss": 0.0, "bf": 0.0, "ok": False, "i": 0.0,
                                                     "tag": ""})
    assert back == {"count": 5, "loss": 0.25, "bf": 1.5, "ok": True, "i": 3.0, "tag": "abc"}
    assert [type(back[k]) for k in ("count", "loss", "bf", "ok", "i", "tag")] == [int, float, float, bool, float, str]


@pytest.mark.parametrize(
    ("saved", "target", "held"),
    [
        ("abc", 0, "the value 'abc'"),  # a str where the target has an int
        (0.5, 0, "the value 0.5"),  # a float is never narrowed into an int
        (1, True, "the value 1"),  # nor an int into a bool
        (True, 0, "the value True"),  # nor a bool into an int
        (2**60 + 1, 0.0, "the value 1152921504606846977"),  # an int a float would round
        (np.arange(3), 0, r"int64\[3\]"),  # an array is no scalar
        (np.float32(1.5), 0, r"float32\[\]"),
        (np.datetime64("2024-01-01"), 0, r"datetime64\[D\]\[\]"),
    ],
)
def test_an_incompatible_scalar_target_is_refused_naming_its_path(
    tmp_path: Path, saved: Any, target: Any, held: str
) -> None:
    ckptio.save(str(tmp_path), {"opt": [{"count": saved}]}, step=1).result()
    with pytest.raises(ValueError, match=rf"item 'opt/0/count': the target is a Python {type(target).__name__} .*"
                                         rf"holds {held}"):
        ckptio.restore(str(tmp_path), 1, target={"opt": [{"count": target}]})


# -- other frameworks and node types ------------------------------------------------------------------


def test_a_torch_state_dict_restores_new_tensors_or_in_place(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].to(torch.bfloat16)
    sd = model.state_dict()
    ckptio.save(str(tmp_path), sd, step=1).result()
    target = ckptio.restore_target(sd)
    assert type(target) is collections.OrderedDict and all(t.device.type == "meta" for t in target.values())
    back = ckptio.restore(str(tmp_path), 1, target=target)
    assert type(back) is collections.OrderedDict and list(back) == list(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and back[k].device.type == "cpu" and torch.equal(back[k], v), k
        assert back[k].data_ptr() != v.data_ptr()
    model.load_state_dict(back)
    # inplace=True: the state's own tensors are the targets and are filled.
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.float32)
    fresh[1].to(torch.bfloat16)
    fsd = fresh.state_dict()
    into = ckptio.restore(str(tmp_path), 1, target=ckptio.restore_target(fsd, inplace=True))
    for k, v in sd.items():
        assert into[k] is fsd[k] and torch.equal(fresh.state_dict()[k], v), k


def test_a_numpy_state_gets_targets_that_allocate_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {
        "big": rng.standard_normal((256, 1024)).astype(np.float32),
        "bf": rng.standard_normal(8).astype(ml_dtypes.bfloat16),
        "ints": [np.arange(5, dtype=">i4"), np.zeros((0, 3), np.uint8)],
        "zero_d": np.array(3.5),
        "np_scalar": np.int16(-4),
        "s": ckptio.Sharded((4, 2), np.float64, [((slice(0, 2),), np.ones((2, 2))), ((slice(2, 4),), np.zeros((2, 2)))]),
    }
    ckptio.save(str(tmp_path), state, step=1).result()
    target = ckptio.restore_target(state)
    assert target["big"].shape == (256, 1024) and target["big"].strides == (0, 0)  # no memory behind it
    assert target["np_scalar"] is state["np_scalar"] and all(d is None for _i, d in target["s"].pieces)
    back = ckptio.restore(str(tmp_path), 1, target=target)
    for got, want in [(back["big"], state["big"]), (back["bf"], state["bf"]), (back["ints"][0], state["ints"][0]),
                      (back["ints"][1], state["ints"][1]), (back["zero_d"], state["zero_d"])]:
        assert type(got) is np.ndarray and got.flags.writeable and not np.shares_memory(got, want)
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    assert type(back["np_scalar"]) is np.int16 and back["np_scalar"] == -4
    assert [(i, d.tolist()) for i, d in back["s"].pieces] == [(i, d.tolist()) for i, d in state["s"].pieces]
    # inplace=True: numpy arrays are filled where they are.
    dest = {**state, "big": np.empty_like(state["big"])}
    into = ckptio.restore(str(tmp_path), 1, target=ckptio.restore_target(dest, inplace=True))
    assert into["big"] is dest["big"] and np.array_equal(dest["big"], state["big"])


class Moments(NamedTuple):
    mu: Any
    count: int


def test_node_types_keys_and_static_fields_come_back(tmp_path: Path) -> None:
    flax = pytest.importorskip("flax")
    nnx = pytest.importorskip("flax.nnx")
    from flax.core import FrozenDict

    @flax.struct.dataclass
    class State:
        params: Any
        rng: Any
        moments: Moments
        history: list[Any]
        name: str = flax.struct.field(pytree_node=False, default="run")

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.dense = nnx.Linear(2, 3, rngs=rngs)

    _graph, nstate = nnx.split(Model(nnx.Rngs(0)))
    state = State(params=FrozenDict({"w": jnp.ones((2, 2)), "nnx": nstate}), rng=jax.random.key(3, impl="rbg"),
                  moments=Moments(jnp.zeros(2), 4), history=[(1, 2.5), ("a", None)], name="mine")
    ckptio.save(str(tmp_path), state, step=1).result()
    back = ckptio.restore(str(tmp_path), 1, target=ckptio.restore_target(state))
    assert type(back) is State and back.name == "mine" and isinstance(back.params, FrozenDict)
    assert type(back.params["nnx"]) is type(nstate) and type(back.moments) is Moments
    assert back.history == [(1, 2.5), ("a", None)] and back.moments.count == 4
    assert jax.random.key_impl(back.rng) == jax.random.key_impl(state.rng)
    _assert_same(back, state)


def test_dict_subclasses_restore_as_their_types(tmp_path: Path) -> None:
    counts = collections.defaultdict(int, {"seen": 3})
    state = {"od": collections.OrderedDict((f"k{i}", np.full(2, i)) for i in range(12)), "counts": counts}
    ckptio.save(str(tmp_path), state, step=1).result()
    back = ckptio.restore(str(tmp_path), 1, target=ckptio.restore_target(state))
    assert type(back["od"]) is collections.OrderedDict and list(back["od"]) == list(state["od"])
    assert type(back["counts"]) is collections.defaultdict and back["counts"]["seen"] == 3
    assert back["counts"]["new"] == 0  # the factory came with it
    assert type(ckptio.restore(str(tmp_path), 1)["od"]) is dict  # without a target: the plain structure


def test_an_unknown_leaf_is_refused_naming_its_path() -> None:
    with pytest.raises(TypeError, match=r"leaf 'a/0/f' is a object"):
        ckptio.restore_target({"a": [{"f": object()}]})


if __name__ == "__main__":  # the 8-device child of mesh_verdicts
    out_dir = Path(sys.argv[1])
    (out_dir / "results.json").write_text(json.dumps(_run_here(out_dir)))
