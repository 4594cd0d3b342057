"""The native API with the pytrees JAX users have, and casting on restore.

Typed PRNG keys, NamedTuples (optax states), jax-registered nodes (flax
``struct.dataclass``, ``FrozenDict``, nnx ``State``) round-trip through
``ckptio.save`` / ``ckptio.restore``: with a target into the target's own
types, without one into the documented plain structure (dicts and lists,
typed keys as typed keys). A target of another dtype is a checked cast; a
target of another shape is refused.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest

import ckptio

jax = pytest.importorskip("jax")
jnp = jax.numpy


def roundtrip(tmp_path: Path, state: Any, target: Any = None) -> Any:
    ckptio.save(str(tmp_path), state, step=1).result()
    return ckptio.restore(str(tmp_path), 1, target=target)


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def same_key(a: Any, b: Any) -> bool:
    return bool(np.array_equal(jax.random.key_data(a), jax.random.key_data(b)))


# -- typed PRNG keys ----------------------------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_come_back_as_typed_keys_with_and_without_a_target(tmp_path: Path, impl: str) -> None:
    keys = jax.random.split(jax.random.key(7, impl=impl), 4)
    state = {"rng": jax.random.key(3, impl=impl), "keys": keys, "step": 5}
    plain = roundtrip(tmp_path, state)
    assert jax.dtypes.issubdtype(plain["rng"].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(plain["rng"]) == jax.random.key_impl(state["rng"])
    assert same_key(plain["rng"], state["rng"]) and same_key(plain["keys"], keys) and plain["step"] == 5
    # The restored key is usable: it draws what the saved one draws.
    assert np.array_equal(jax.random.normal(plain["rng"], (3,)), jax.random.normal(state["rng"], (3,)))
    targeted = ckptio.restore(str(tmp_path), 1, target={"rng": abstract(state["rng"]), "keys": keys, "step": 0})
    assert same_key(targeted["rng"], state["rng"]) and same_key(targeted["keys"], keys)


def test_a_prng_key_target_against_other_data_names_the_item(tmp_path: Path) -> None:
    ckptio.save(str(tmp_path), {"rng": np.zeros(3, np.float32)}, step=1).result()
    with pytest.raises(ValueError, match="'rng'.*PRNG key"):
        ckptio.restore(str(tmp_path), 1, target={"rng": jax.random.key(0)})


# -- NamedTuples, optax, flax -------------------------------------------------


class Point(NamedTuple):
    x: np.ndarray
    label: str


def test_namedtuples_save_and_restore_into_their_type_or_as_dicts(tmp_path: Path) -> None:
    Pair = collections.namedtuple("Pair", ["a", "b"])
    state = {"p": Point(np.arange(3.0), "origin"), "q": Pair(np.ones(2, np.int32), None), "empty": Pair(1, 2)}
    plain = roundtrip(tmp_path, state)
    assert set(plain["p"]) == {"x", "label"} and plain["p"]["label"] == "origin"  # documented: a dict of fields
    np.testing.assert_array_equal(plain["p"]["x"], state["p"].x)
    back = ckptio.restore(str(tmp_path), 1, target=state)
    assert type(back["p"]) is Point and type(back["q"]) is Pair and back["q"].b is None
    np.testing.assert_array_equal(back["q"].a, state["q"].a)


def test_optax_adam_state_roundtrips_with_and_without_a_target(tmp_path: Path) -> None:
    optax = pytest.importorskip("optax")
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    opt_state = tx.init(params)
    _, opt_state = tx.update(params, opt_state, params)[0], tx.update(params, opt_state, params)[1]
    state = {"params": params, "opt_state": opt_state}
    plain = roundtrip(tmp_path, state)
    adam = plain["opt_state"][1][0]
    assert set(adam) == {"count", "mu", "nu"}  # ScaleByAdamState as a dict of its fields
    np.testing.assert_array_equal(adam["mu"]["w"], opt_state[1][0].mu["w"])
    back = ckptio.restore(str(tmp_path), 1, target=abstract(state))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert type(back["opt_state"][1][0]).__name__ == "ScaleByAdamState"
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    tx.update(params, back["opt_state"], params)  # optax accepts the restored state


def test_flax_struct_dataclass_and_frozendict_roundtrip(tmp_path: Path) -> None:
    flax = pytest.importorskip("flax")
    from flax.core import FrozenDict

    @flax.struct.dataclass
    class TrainState:
        params: Any
        rng: Any
        count: Any
        name: str = flax.struct.field(pytree_node=False, default="run")

    state = TrainState(params=FrozenDict({"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}}),
                       rng=jax.random.key(1), count=jnp.int32(4), name="mine")
    plain = roundtrip(tmp_path, state)
    # documented: attributes and mapping keys as dicts; static fields are the target's, not saved
    assert set(plain) == {"params", "rng", "count"} and set(plain["params"]["dense"]) == {"kernel", "bias"}
    assert same_key(plain["rng"], state.rng)
    back = ckptio.restore(str(tmp_path), 1, target=abstract(state))
    assert type(back) is TrainState and isinstance(back.params, FrozenDict) and back.name == "mine"
    assert jax.tree.structure(back) == jax.tree.structure(state)
    np.testing.assert_array_equal(back.params["dense"]["kernel"], state.params["dense"]["kernel"])
    assert same_key(back.rng, state.rng) and int(back.count) == 4


def test_flax_nnx_state_roundtrips_into_its_types(tmp_path: Path) -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.dense = nnx.Linear(2, 3, rngs=rngs)

    _graph, nstate = nnx.split(Model(nnx.Rngs(0)))
    plain = roundtrip(tmp_path, nstate)
    np.testing.assert_array_equal(plain["dense"]["kernel"]["value"], nstate["dense"]["kernel"].value)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nstate)
    back = ckptio.restore(str(tmp_path), 1, target=target)
    assert type(back) is type(nstate) and jax.tree.structure(back) == jax.tree.structure(nstate)
    np.testing.assert_array_equal(back["dense"]["kernel"].value, nstate["dense"]["kernel"].value)


def test_a_node_with_unnameable_children_is_refused_naming_its_path(tmp_path: Path) -> None:
    @jax.tree_util.register_pytree_with_keys_class
    class Weird:
        def tree_flatten_with_keys(self) -> Any:
            return [(jax.tree_util.DictKey((1, 2)), np.ones(2))], None

        @classmethod
        def tree_unflatten(cls, aux: Any, children: Any) -> Any:
            return cls()

    with pytest.raises(TypeError, match="'a/w'"):
        ckptio.save(str(tmp_path), {"a": {"w": Weird()}}, step=1)


# -- casting on restore -------------------------------------------------------


def test_float32_checkpoint_restores_into_bfloat16_targets(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = (np.arange(12, dtype=np.float32) / 3).reshape(3, 4)
    ckptio.save(str(tmp_path), {"w": w, "v": w, "s": w, "t": w}, step=1).result()
    bf16 = ml_dtypes.bfloat16
    target = {
        "w": np.zeros((3, 4), bf16),  # filled in place
        "v": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
        "s": ckptio.Sharded((3, 4), bf16, [((slice(1, 3),), None)]),
        "t": torch.zeros((3, 4), dtype=torch.bfloat16),
    }
    out = ckptio.restore(str(tmp_path), 1, target=target)
    want = w.astype(bf16)
    assert out["w"] is target["w"] and out["w"].dtype == bf16
    np.testing.assert_array_equal(out["w"], want)
    assert out["v"].dtype == jnp.bfloat16 and np.array_equal(np.asarray(out["v"]), want)
    assert out["s"].dtype == bf16 and np.array_equal(out["s"].pieces[0][1], want[1:3])
    assert out["t"] is target["t"] and torch.equal(out["t"], torch.from_numpy(w).to(torch.bfloat16))


def test_integer_width_casts_pass_when_every_value_fits_and_are_refused_naming_the_item(tmp_path: Path) -> None:
    ckptio.save(str(tmp_path), {"small": np.arange(5, dtype=np.int64), "big": np.array([1, 300], np.int32),
                                "frac": np.array([1.0, 1.5], np.float32)}, step=1).result()
    out = ckptio.restore(str(tmp_path), 1, target={"small": np.zeros(5, np.int8), "big": None, "frac": None})
    assert out["small"].dtype == np.int8 and out["small"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"item 'big'.*300.*int8"):
        ckptio.restore(str(tmp_path), 1, target={"big": np.zeros(2, np.int8)})
    with pytest.raises(ValueError, match=r"item 'frac'.*1\.5"):
        ckptio.restore(str(tmp_path), 1, target={"frac": jax.ShapeDtypeStruct((2,), jnp.int32)})


def test_a_float_cast_that_overflows_is_refused(tmp_path: Path) -> None:
    ckptio.save(str(tmp_path), {"x": np.array([1.0, 1e30])}, step=1).result()
    with pytest.raises(ValueError, match=r"item 'x'.*float16"):
        ckptio.restore(str(tmp_path), 1, target={"x": np.zeros(2, np.float16)})


@pytest.mark.parametrize("shape", [(4, 3), (12,), (3, 5)])
def test_a_target_of_another_shape_is_refused_never_reshaped(tmp_path: Path, shape: tuple[int, ...]) -> None:
    ckptio.save(str(tmp_path), {"w": np.zeros((3, 4), np.float32)}, step=1).result()
    for target in (np.zeros(shape, np.float32), jax.ShapeDtypeStruct(shape, jnp.bfloat16)):
        with pytest.raises(ValueError, match=r"item 'w'.*never reshapes"):
            ckptio.restore(str(tmp_path), 1, target={"w": target})


def test_a_cast_to_an_unrelated_kind_is_refused(tmp_path: Path) -> None:
    ckptio.save(str(tmp_path), {"w": np.zeros(3, np.float32)}, step=1).result()
    with pytest.raises(ValueError, match="item 'w'.*cannot be cast"):
        ckptio.restore(str(tmp_path), 1, target={"w": np.zeros(3, "U4")})


def test_cast_core_imports_no_framework() -> None:
    import subprocess
    import sys

    code = "import sys, ckptio.state.cast; assert 'jax' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unsupported_leaf_names_its_path_and_what_is_supported(tmp_path: Path) -> None:
    with pytest.raises(ckptio.UnsupportedLeafError, match=r"opt/0/fn.*NamedTuples.*never pickle"):
        ckptio.save(str(tmp_path), {"opt": ({"fn": object()},)}, step=1)


@pytest.mark.parametrize(
    ("index", "error", "why"),
    [
        ((0, slice(0, 4)), TypeError, "only slices"),
        ((slice(0, 8, 2), slice(None)), ValueError, "strided"),
        ((slice(0, 4), slice(None), slice(None)), ValueError, "more slices than the 2 dimensions"),
    ],
)
def test_a_sharded_piece_with_a_bad_index_names_its_path_and_commits_nothing(
    tmp_path: Path, index: tuple[Any, ...], error: type[Exception], why: str
) -> None:
    big = np.zeros((4096, 4096), np.float32)  # 64 MiB: the default writer is chosen from it first
    leaf = ckptio.Sharded((8, 4), np.float32, [(index, np.zeros((4, 4), np.float32))])
    with pytest.raises(error, match=rf"model/w: index .*{why}"):
        ckptio.save(str(tmp_path), {"model": {"w": leaf, "big": big}}, step=1)
    with pytest.raises(ckptio.CheckpointNotFoundError):
        ckptio.restore(str(tmp_path), step=1)
