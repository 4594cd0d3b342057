"""Dtype fidelity of ckptio.orbax on 8 CPU devices, run in a subprocess by tests/orbax/test_orbax.py.

Usage as tests/scenarios/orbax_scenarios.py (whose runner and helpers this reuses):
``orbax_dtype_scenarios.py <workdir> [scenario ...]``.

The rule under test: a restore never changes a dtype the caller did not ask
to change. Where jax cannot hold the saved dtype (``jax_enable_x64`` off, a
64-bit item restored as a jax array) it narrows only if every value
survives, and otherwise raises naming the item; numpy leaves asked for
without a sharding come back as numpy, in their dtype.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import orbax_scenarios as base
from etils import epath
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import ckptio.orbax

scenario, bits, put = base.scenario, base.bits, base.put

#: Values no 32-bit type holds: what jax with x64 off would silently wrap or overflow.
BIG = {
    "i64": np.array([2**40 + 1, -(2**35), 7, 0, 2**62, -1, 3, 5], np.int64),
    "u64": np.array([2**63 + 5, 2**32, 1, 0, 2**64 - 1, 9, 2, 4], np.uint64),
    "f64": np.array([1e300, 0.1, -2.5, 1e-310, np.inf, np.nan, 0.0, 3.0], np.float64),
}
#: 64-bit values that a 32-bit type holds exactly: jax may narrow these.
SMALL = {
    "i64_small": np.arange(-4, 4, dtype=np.int64),
    "f64_small": np.array([0.5, -1.0, 2.0, np.inf, np.nan, 0.0, 8.0, 1.25], np.float64),
}


def mesh8() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("x",))


@contextlib.contextmanager
def x64(on: bool) -> Iterator[None]:
    """Process-wide jax_enable_x64 (Orbax restores on other threads, which a context would not reach)."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def same(got: Any, want: np.ndarray, what: str, kind: type | tuple[type, ...] | None = None) -> None:
    """``got`` has ``want``'s dtype and bits (and is a ``kind``)."""
    assert bits(got) == bits(want), (
        f"{what}: {np.asarray(got).dtype} {np.asarray(got)!r} != {want.dtype} {want!r}"
    )
    if kind is not None:
        assert isinstance(got, kind), f"{what}: {type(got).__name__}, not {kind}"


def raises_naming(items: str | set[str], fn: Callable[[], Any], what: str) -> None:
    """``fn`` raises a ValueError that names the item (one of ``items``)."""
    names = {items} if isinstance(items, str) else items
    try:
        fn()
    except ValueError as e:
        assert any(f"item {n!r}" in str(e) for n in names), f"{what}: the error names none of {names}: {e}"
    else:
        raise AssertionError(f"{what}: restored without an error")


def sds(x: np.ndarray, sharding: Any = None, dtype: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sharding)


@scenario
def numpy_int64_x64_off(root: str) -> None:
    """The issue's case: numpy 64-bit leaves, Save/Restore, x64 off."""
    assert not jax.config.jax_enable_x64
    state = {**BIG, **SMALL, "scalar": np.int64(2**40)}
    mesh = mesh8()
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(1, args=ckptio.orbax.Save(state))
        mngr.wait_until_finished()
        # No sharding: numpy, in the saved dtype (as Orbax returns it); never a narrowed jax array.
        for name, out in (
            (
                "ShapeDtypeStruct(sharding=None)",
                mngr.restore(1, args=ckptio.orbax.Restore({k: sds(np.asarray(v)) for k, v in state.items()})),
            ),
            (
                "np.ndarray",
                mngr.restore(1, args=ckptio.orbax.Restore({k: np.zeros_like(v) for k, v in state.items()})),
            ),
            ("no target", mngr.restore(1, args=ckptio.orbax.Restore())),
        ):
            for k, v in state.items():
                # (a saved numpy scalar asked for as an array of shape () may come back as one)
                same(
                    out[k],
                    np.asarray(v),
                    f"{name}: {k}",
                    (np.generic, np.ndarray) if k == "scalar" else np.ndarray,
                )
        # A jax array on devices cannot be 64-bit here: the values that 32 bits cannot hold raise.
        for sharding in (
            NamedSharding(mesh, P("x")),
            NamedSharding(mesh, P()),
            SingleDeviceSharding(jax.devices()[3]),
        ):
            for k, v in BIG.items():
                raises_naming(
                    k,
                    partial(mngr.restore, 1, args=ckptio.orbax.Restore({k: sds(v, sharding)})),
                    str(sharding),
                )
            out = mngr.restore(1, args=ckptio.orbax.Restore({k: sds(v, sharding) for k, v in SMALL.items()}))
            for k, v in SMALL.items():  # ... and those it holds come back exactly, in jax's dtype
                assert out[k].sharding == sharding and out[k].dtype == jax.dtypes.canonicalize_dtype(
                    v.dtype
                ), k
                assert np.array_equal(np.asarray(out[k]), v, equal_nan=True), k
        # Casts the caller asks for: rounding a float is fine, overflow and wrap-around are not.
        sh = NamedSharding(mesh, P("x"))
        out = mngr.restore(
            1, args=ckptio.orbax.Restore({"f64_small": sds(SMALL["f64_small"], sh, ml_dtypes.bfloat16)})
        )
        assert out["f64_small"].dtype == ml_dtypes.bfloat16
        raises_naming(
            "f64",
            partial(mngr.restore, 1, args=ckptio.orbax.Restore({"f64": sds(BIG["f64"], sh, np.float32)})),
            "f64->f32",
        )
        raises_naming(
            "i64",
            partial(mngr.restore, 1, args=ckptio.orbax.Restore({"i64": np.zeros(8, np.int32)})),
            "i64->np i32",
        )
        out = mngr.restore(1, args=ckptio.orbax.Restore({"i64_small": np.zeros(8, np.int8)}))
        assert out["i64_small"].dtype == np.int8 and np.array_equal(out["i64_small"], SMALL["i64_small"])


@scenario
def jax_int64_save_restore(root: str) -> None:
    """jax 64-bit leaves saved with x64 on (Save/Restore), restored with x64 on and off."""
    with x64(True):
        m = base.mesh_4x2()
        state = {k: put(v, m, P("x")) for k, v in {**BIG, **SMALL}.items()}
        want = {k: np.asarray(v) for k, v in state.items()}
        with ocp.CheckpointManager(root) as mngr:
            mngr.save(1, args=ckptio.orbax.Save(state))
            mngr.wait_until_finished()
            for sharding in (base.transposed(state["i64"]), None):
                out = mngr.restore(
                    1, args=ckptio.orbax.Restore({k: sds(v, sharding) for k, v in want.items()})
                )
                for k in want:
                    same(out[k], want[k], f"x64 on, sharding {sharding}: {k}", jax.Array)
            out = mngr.restore(1, args=ckptio.orbax.Restore())
            for k in want:
                same(out[k], want[k], f"x64 on, no target: {k}", jax.Array)
    with ocp.CheckpointManager(root) as mngr:  # x64 off
        for k, v in BIG.items():
            raises_naming(
                k,
                partial(
                    mngr.restore, 1, args=ckptio.orbax.Restore({k: sds(v, base.transposed(state["i64"]))})
                ),
                k,
            )
            raises_naming(k, partial(mngr.restore, 1, args=ckptio.orbax.Restore({k: sds(v)})), k)
        raises_naming(set(BIG), partial(mngr.restore, 1, args=ckptio.orbax.Restore()), "no target")
        out = mngr.restore(1, args=ckptio.orbax.Restore({k: np.zeros_like(v) for k, v in want.items()}))
        for k in want:
            same(out[k], want[k], f"x64 off, numpy target: {k}", np.ndarray)
        # The x64 context on the caller's thread is honoured too.
        with jax.enable_x64(True):
            out = mngr.restore(
                1,
                args=ckptio.orbax.Restore(
                    {k: sds(v, NamedSharding(mesh8(), P("x"))) for k, v in want.items()}
                ),
            )
            for k in want:
                same(out[k], want[k], f"enable_x64 context: {k}", jax.Array)


def _sharded_abstract(tree: dict[str, Any], sharding: Any) -> dict[str, Any]:
    return {k: sds(np.asarray(v), sharding) for k, v in tree.items()}


@scenario
def type_handler_int64(root: str) -> None:
    """register(): jax 64-bit leaves through StandardSave / PyTreeSave, restored with x64 on and off."""
    ckptio.orbax.register()
    try:
        with x64(True):
            m = base.mesh_4x2()
            big = {k: put(v, m, P("x")) for k, v in BIG.items()}
            small = {k: put(v, m, P("x")) for k, v in SMALL.items()}
            want = {k: np.asarray(v) for k, v in {**big, **small}.items()}
            with ocp.CheckpointManager(os.path.join(root, "pytree")) as mngr:
                mngr.save(2, args=ocp.args.PyTreeSave(small))
                mngr.wait_until_finished()
                out = mngr.restore(
                    2, args=ocp.args.PyTreeRestore(_sharded_abstract(small, NamedSharding(mesh8(), P())))
                )
                for k in small:
                    same(out[k], want[k], f"x64 on, PyTreeRestore: {k}", jax.Array)
            with ocp.CheckpointManager(os.path.join(root, "standard")) as mngr:
                mngr.save(1, args=ocp.args.StandardSave(big))
                mngr.wait_until_finished()
                for target in (_sharded_abstract(big, base.transposed(big["i64"])), None):
                    out = mngr.restore(1, args=ocp.args.StandardRestore(target))
                    for k in big:
                        same(out[k], want[k], f"x64 on, target {target is not None}: {k}", jax.Array)
        with ocp.CheckpointManager(os.path.join(root, "standard")) as mngr:  # x64 off
            for target in (_sharded_abstract(big, NamedSharding(mesh8(), P("x"))), None):
                raises_naming(
                    set(BIG), partial(mngr.restore, 1, args=ocp.args.StandardRestore(target)), "x64 off"
                )
            # As numpy, every value comes back (Orbax's own numpy handler would look for TensorStore data).
            out = mngr.restore(1, args=ocp.args.StandardRestore({k: np.zeros_like(want[k]) for k in big}))
            for k in big:
                same(out[k], want[k], f"x64 off, numpy target: {k}", np.ndarray)
            with jax.enable_x64(True):  # the caller's thread-local x64 reaches ckptio's restore thread
                out = mngr.restore(
                    1, args=ocp.args.StandardRestore(_sharded_abstract(big, NamedSharding(mesh8(), P("x"))))
                )
                for k in big:
                    same(out[k], want[k], f"enable_x64 context: {k}", jax.Array)
        with ocp.CheckpointManager(os.path.join(root, "pytree")) as mngr:
            sharding = NamedSharding(mesh8(), P("x"))
            for out in (
                mngr.restore(2, args=ocp.args.PyTreeRestore(_sharded_abstract(small, sharding))),
                mngr.restore(2, args=ocp.args.PyTreeRestore()),
            ):
                for k in small:  # 32 bits hold these exactly: narrowed, as jax must
                    assert out[k].dtype == jax.dtypes.canonicalize_dtype(want[k].dtype), (k, out[k].dtype)
                    assert np.array_equal(np.asarray(out[k]), want[k], equal_nan=True), k
    finally:
        ckptio.orbax.unregister()


def _multi_mesh_tree() -> dict[str, jax.Array]:
    """Leaves committed to different device sets and meshes (as Orbax's own test trees are)."""
    devices = np.asarray(jax.devices())
    mesh_1d = jax.sharding.Mesh(devices, ("x",))
    mesh_2d = jax.sharding.Mesh(devices.reshape(2, 4), ("x", "y"))
    mesh_4 = jax.sharding.Mesh(devices[4:], ("x",))
    return {
        "a": jax.device_put(np.arange(8), NamedSharding(mesh_1d, P(None))),
        "b": jax.device_put(np.arange(16) * 40, NamedSharding(mesh_1d, P("x"))),  # past int8
        "c": {
            "a": jax.device_put(np.arange(8).reshape(2, 4) * 3, NamedSharding(mesh_2d, P("x", "y"))),
            "e": jax.device_put(np.arange(16).reshape(4, 4) * 4, NamedSharding(mesh_4, P("x"))),
        },
    }


@scenario
def type_handler_cast(root: str) -> None:
    """register() + SaveArgs.dtype / RestoreArgs.dtype (Orbax's test_cast), also inside a jax.set_mesh
    context of another mesh, where a jitted astype on the restored arrays fails."""
    tree = _multi_mesh_tree()
    ckptio.orbax.register()
    try:
        for n, context in enumerate((contextlib.nullcontext(), jax.set_mesh(jax.make_mesh((8,), ("z",))))):
            path = epath.Path(root) / str(n)
            with context:
                with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
                    save_args = jax.tree.map(lambda _: ocp.SaveArgs(dtype=np.dtype(np.float32)), tree)
                    ckptr.save(path, args=ocp.args.StandardSave(tree, save_args=save_args))
                    meta = ckptr.metadata(path).item_metadata
                    assert all(m.dtype == np.float32 for m in jax.tree.leaves(meta.tree)), meta
                    target = jax.tree.map(
                        lambda x: jax.ShapeDtypeStruct(x.shape, ml_dtypes.bfloat16, sharding=x.sharding), tree
                    )
                    out = ckptr.restore(path, args=ocp.args.StandardRestore(target))
                for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
                    assert got.dtype == ml_dtypes.bfloat16 and got.sharding == want.sharding, (n, got)
                    rounded = (
                        np.asarray(want).astype(np.float32).astype(ml_dtypes.bfloat16)
                    )  # asked: may round
                    assert np.array_equal(np.asarray(got), rounded), n
                # PyTreeRestore with RestoreArgs.dtype, onto each leaf's own mesh.
                restore_args = jax.tree.map(
                    lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=np.uint32), tree
                )
                with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
                    out = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
                for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
                    assert got.dtype == np.uint32 and np.array_equal(np.asarray(got), np.asarray(want)), n
        # A cast that cannot hold the values is refused, naming the item: on restore ...
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=np.int8), tree)
            raises_naming(
                "b",
                partial(
                    ckptr.restore, epath.Path(root) / "0", args=ocp.args.PyTreeRestore(restore_args=args)
                ),
                "int8 restore",
            )
        # ... and on save.
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            save_args = jax.tree.map(lambda _: ocp.SaveArgs(dtype=np.dtype(np.int8)), tree)
            raises_naming(
                "b",
                partial(
                    ckptr.save,
                    epath.Path(root) / "int8",
                    args=ocp.args.StandardSave(tree, save_args=save_args),
                ),
                "int8 save",
            )
    finally:
        ckptio.orbax.unregister()


# -- the property: any saved dtype restores to the same dtype and values ---------

DTYPES = [
    np.dtype(t)
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.int4,
        ml_dtypes.uint4,
    )
]
SHAPES = [(), (0,), (8,), (16, 3), (4, 6), (0, 8)]


def values_of(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Any values of ``dtype``: every bit pattern for floats (NaNs, infs, subnormals), the full range for ints."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if dtype in (ml_dtypes.int4, ml_dtypes.uint4):  # sub-byte: only valid values, not raw bytes
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, n).astype(dtype).reshape(shape)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    return base.rand_bits(rng, shape, dtype)


def jax_can_hold(dtype: np.dtype) -> bool:
    return jax.dtypes.canonicalize_dtype(dtype) == dtype


def check_restored(got: Any, want: np.ndarray, kind: str, what: str) -> None:
    """``kind`` "numpy": the saved dtype and bits, as numpy. "jax": the same as a jax array, or -- only
    where jax cannot hold the dtype (x64 off) -- jax's narrower dtype with every value intact."""
    if kind == "numpy":
        assert isinstance(got, (np.ndarray, np.generic)), f"{what}: {type(got).__name__}"
        same(np.asarray(got), want, what)
        return
    assert isinstance(got, jax.Array), f"{what}: {type(got).__name__}"
    if jax_can_hold(want.dtype):
        same(got, want, what)
    else:
        narrow = jax.dtypes.canonicalize_dtype(want.dtype)
        assert got.dtype == narrow, f"{what}: {got.dtype}, not {narrow}"
        assert np.array_equal(np.asarray(got).astype(want.dtype), want, equal_nan=True), what


def fits_narrowed(want: np.ndarray) -> bool:
    """Whether jax's dtype for ``want`` (x64 off) holds every value exactly."""
    narrow = jax.dtypes.canonicalize_dtype(want.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        back = want.astype(narrow).astype(want.dtype)
    return bool(np.array_equal(back, want, equal_nan=np.issubdtype(want.dtype, np.inexact)))


def expect(fn: Callable[[], Any], want: np.ndarray, kind: str, what: str) -> None:
    """Restore with ``fn``: as :func:`check_restored` says, or a ValueError naming item 'v' when
    the result is a jax array whose dtype (x64 off) cannot hold the saved values."""
    if kind == "jax" and not jax_can_hold(want.dtype) and not fits_narrowed(want):
        raises_naming("v", fn, what)
        return
    got = fn()
    check_restored(got["v"], want, kind, what)


def _shardings(shape: tuple[int, ...]) -> list[Any]:
    mesh = mesh8()
    spec = P("x") if shape and shape[0] % 8 == 0 else P()
    return [NamedSharding(mesh, spec), SingleDeviceSharding(jax.devices()[5])]


PROPERTY_SETTINGS: dict[str, Any] = {"max_examples": 40, "deadline": None, "database": None}


@scenario
def property_save_restore(root: str) -> None:
    """ckptio.orbax.Save / Restore: every dtype, numpy and jax leaves, every target form, x64 on and off."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    handler = ckptio.orbax.CkptioCheckpointHandler()
    counter = iter(range(10**9))

    @settings(**PROPERTY_SETTINGS, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.integers(0, 2**32), st.booleans(), st.booleans()
    )
    def prop(dtype: np.dtype, shape: tuple[int, ...], seed: int, as_jax: bool, x64_on: bool) -> None:
        want = values_of(dtype, shape, seed)
        path = epath.Path(root) / str(next(counter))
        with x64(True):  # a jax leaf of any dtype exists only with x64 on
            leaf = put(want, mesh8(), _shardings(shape)[0].spec) if as_jax else want
            handler.save(path, ckptio.orbax.Save({"v": leaf}))
        saved = "jax" if as_jax else "numpy"
        with x64(x64_on):

            def restore(t: Any) -> Any:
                return handler.restore(path, ckptio.orbax.Restore(t))

            expect(partial(restore, None), want, saved, "no target")
            expect(partial(restore, {"v": sds(want)}), want, saved, "ShapeDtypeStruct(sharding=None)")
            expect(partial(restore, {"v": np.zeros(shape, dtype)}), want, "numpy", "np.ndarray")
            for sharding in _shardings(shape):
                expect(partial(restore, {"v": sds(want, sharding)}), want, "jax", f"on {sharding}")
                if jax_can_hold(dtype):  # a concrete jax array target of the same dtype
                    out = restore({"v": jax.device_put(np.zeros(shape, dtype), sharding)})
                    check_restored(out["v"], want, "jax", f"jax.Array on {sharding}")
                    assert out["v"].sharding == sharding

    prop()


@scenario
def property_type_handler(root: str) -> None:
    """register(): every dtype of jax leaves through StandardSave, every StandardRestore target form."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ckptio.orbax.register()
    counter = iter(range(10**9))
    try:

        @settings(**PROPERTY_SETTINGS, suppress_health_check=list(HealthCheck))
        @given(
            st.sampled_from(DTYPES),
            st.sampled_from(SHAPES),
            st.integers(0, 2**32),
            st.booleans(),
        )
        def prop(dtype: np.dtype, shape: tuple[int, ...], seed: int, x64_on: bool) -> None:
            want = values_of(dtype, shape, seed)
            path = epath.Path(root) / str(next(counter))
            with x64(True), ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
                ckptr.save(
                    path, args=ocp.args.StandardSave({"v": put(want, mesh8(), _shardings(shape)[0].spec)})
                )
            with x64(x64_on), ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:

                def restore(t: Any) -> Any:
                    return ckptr.restore(path, args=ocp.args.StandardRestore(t))

                expect(partial(restore, None), want, "jax", "no target (the saved sharding)")
                expect(partial(restore, {"v": np.zeros(shape, dtype)}), want, "numpy", "np.ndarray")
                for sharding in _shardings(shape):
                    expect(partial(restore, {"v": sds(want, sharding)}), want, "jax", f"on {sharding}")

        prop()
    finally:
        ckptio.orbax.unregister()


if __name__ == "__main__":
    base.main()
