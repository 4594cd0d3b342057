"""Orbax behaviours ckptio.orbax matches (issue 20, items 3-5), on 8 CPU devices; run by
tests/orbax/test_orbax_compat.py.

Usage as tests/scenarios/orbax_scenarios.py (whose runner and helpers this reuses):
``orbax_compat_scenarios.py <workdir> [scenario ...]``.

* shape changes: ``strict=False`` pads with zeros or truncates at the end of
  each dimension (same rank only); ``strict=True`` and a rank change raise,
  naming the item -- in both adapter modes, under Orbax's own arguments;
* the metadata API: ``TreeMetadata`` with ``custom_metadata``, ``ArrayMetadata``
  with ``storage.write_shape``, ``CheckpointManager.item_metadata``;
* the topology check of a restore without a target (``jax.devices`` mocked);
* issue 16: stock Orbax reading a ``register()`` item is told to call
  ``register()``; ``ckptio.orbax.CheckpointManager`` refuses a file as its root.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import orbax_scenarios as base
from etils import epath
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import transform_utils
from orbax.checkpoint._src.metadata import value as value_metadata

import ckptio.orbax

scenario, put = base.scenario, base.put


def mesh8() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("x",))


def resized(saved: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """What Orbax returns for ``saved`` asked for as ``shape`` under strict=False: cut, or zero-padded."""
    out = np.zeros(shape, saved.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(saved.shape, shape))
    out[common] = saved[common]
    return out


def equal(got: Any, want: np.ndarray, what: str) -> None:
    host = np.asarray(got)
    assert host.shape == want.shape and host.dtype == want.dtype, (
        f"{what}: {host.dtype}{host.shape} != {want.dtype}{want.shape}"
    )
    assert np.array_equal(host, want), f"{what}: {host!r} != {want!r}"


def raises(fn: Callable[[], Any], *words: str, what: str) -> None:
    """``fn`` raises a ValueError whose message holds every one of ``words``."""
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), f"{what}: {words} not all in {e}"
    else:
        raise AssertionError(f"{what}: no error")


#: (saved shape, partition spec of the save, target shape, target spec): pads, truncations, both at once,
#: target slices wholly beyond the saved array (only zeros), uneven splits.
SHAPES = [
    ((8,), P("x"), (16,), P("x")),
    ((16,), P("x"), (8,), P("x")),
    ((4,), P(), (16,), P("x")),  # devices 2..7 hold only padding: nothing read for them
    ((8, 6), P("x", None), (4, 10), P(None, None)),
    ((8, 6), P(None, None), (16, 3), P("x", None)),
    ((2, 3), P(), (3, 2), None),  # no sharding: one host buffer
]


@scenario
def reshape_save_restore(root: str) -> None:
    """Save/Restore: Restore(strict=False) pads or truncates every target form; strict=True raises."""
    mesh = mesh8()
    rng = np.random.default_rng(0)
    for i, (saved_shape, save_spec, shape, spec) in enumerate(SHAPES):
        data = rng.integers(1, 1000, saved_shape).astype(np.float32)  # no zeros: padding shows
        state = {"j": put(data, mesh, save_spec), "n": data.copy()}
        path = os.path.join(root, str(i))
        with ocp.CheckpointManager(path) as mngr:
            mngr.save(1, args=ckptio.orbax.Save(state))
            mngr.wait_until_finished()
            want = resized(data, shape)
            sharding = NamedSharding(mesh, spec) if spec is not None else None
            for leaf, dtype in itertools.product(("j", "n"), (np.float32, ml_dtypes.bfloat16)):
                target = {leaf: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)}
                what = f"{saved_shape}->{shape} {leaf} {np.dtype(dtype)} on {spec}"
                out = mngr.restore(1, args=ckptio.orbax.Restore(target, strict=False))[leaf]
                equal(out, want.astype(dtype), what)
                if sharding is not None:
                    assert out.sharding == sharding, what
                raises(
                    partial(mngr.restore, 1, args=ckptio.orbax.Restore(target)),
                    f"item {leaf!r}",
                    "strict=False",
                    what=f"{what}, strict",
                )
            # numpy targets too (np.ndarray leaves come back as numpy).
            out = mngr.restore(1, args=ckptio.orbax.Restore({"n": np.zeros(shape, np.float32)}, strict=False))
            assert isinstance(out["n"], np.ndarray)
            equal(out["n"], want, f"{saved_shape}->{shape} np.ndarray")
            # Another rank is a reshape, which Orbax refuses too: never done, strict or not.
            bad = {"j": jax.ShapeDtypeStruct((*shape, 1), np.float32)}
            raises(
                partial(mngr.restore, 1, args=ckptio.orbax.Restore(bad, strict=False)),
                "item 'j'",
                "another rank",
                what="rank",
            )


@scenario
def reshape_type_handler(root: str) -> None:
    """register(): Orbax's own arguments -- ArrayRestoreArgs(global_shape, strict), StandardRestore(strict),
    and RestoreTransform's multi_value_fn_input_args (Orbax's test_transform)."""
    ckptio.orbax.register()
    try:
        mesh = mesh8()
        xs = P("x")
        data = np.arange(1, 17, dtype=np.float32)
        path = epath.Path(root) / "pytree"
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave({"x": put(data[:8], mesh, xs), "y": put(data, mesh, xs)}))
            for name, shape in (("x", (16,)), ("y", (8,)), ("y", (24,))):
                src = data[:8] if name == "x" else data
                for strict in (False, True):
                    args = {k: ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=xs) for k in ("x", "y")}
                    args[name] = ocp.ArrayRestoreArgs(mesh=mesh, mesh_axes=xs, global_shape=shape, strict=strict)
                    fn = partial(ckptr.restore, path, args=ocp.args.PyTreeRestore(restore_args=args))
                    if strict:
                        raises(fn, f"item {name!r}", what=f"{name}->{shape} strict")
                    else:
                        got = fn()[name]
                        equal(got, resized(src, shape), f"{name}->{shape}")
                        assert got.sharding == NamedSharding(mesh, xs)
            # Orbax's test_transform: a multi-value transform reading two leaves, one resized.
            rep = NamedSharding(mesh, P(None))
            out = ckptr.restore(
                path,
                args=ocp.args.PyTreeRestore(
                    item={"added": 0},
                    restore_args={"added": ocp.RestoreArgs(restore_type=None)},
                    transforms={
                        "added": transform_utils.RestoreTransform(
                            multi_value_fn=lambda key, tree, args: tree["x"] + tree["y"],
                            multi_value_fn_input_args={
                                "x": ocp.ArrayRestoreArgs(sharding=rep, global_shape=(16,), strict=False),
                                "y": ocp.ArrayRestoreArgs(sharding=rep, strict=False),
                            },
                        )
                    },
                ),
            )
            equal(out["added"], resized(data[:8], (16,)) + data, "transform")
        # StandardRestore(strict=False), Orbax's test_change_shape: a target of another size.
        path = epath.Path(root) / "standard"
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ocp.args.StandardSave({"x": put(np.arange(8), mesh, P(None))}))
            target = {"x": jax.ShapeDtypeStruct((4,), np.int32, sharding=NamedSharding(mesh, P(None)))}
            out = ckptr.restore(path, args=ocp.args.StandardRestore(target, strict=False))
            equal(out["x"], np.arange(4, dtype=np.int32), "StandardRestore strict=False")
            raises(
                partial(ckptr.restore, path, args=ocp.args.StandardRestore(target)), "item 'x'", what="strict"
            )
    finally:
        ckptio.orbax.unregister()


@scenario
def metadata_api(root: str) -> None:
    """handler.metadata() and CheckpointManager.item_metadata(): Orbax's TreeMetadata, in both modes."""
    mesh = base.mesh_4x2()
    state = {
        "w": put(np.arange(64, dtype=np.float32).reshape(8, 8), mesh, P("x", "y")),  # shards (2, 4)
        "v": put(np.arange(8, dtype=np.int32), mesh, P("x")),  # shards (2,)
        "n": np.arange(6, dtype=np.int64).reshape(2, 3),
        "step": 7,
        "lr": 0.5,
        "name": "run",
    }
    # Save/Restore: the handler itself, and the manager (same one, and a fresh one told the handler).
    path = os.path.join(root, "save")
    with ocp.CheckpointManager(path) as mngr:
        mngr.save(1, args=ckptio.orbax.Save(state, metadata={"foo": 1}))
        mngr.wait_until_finished()
        same_manager = mngr.item_metadata(1)
    handler = ckptio.orbax.CkptioCheckpointHandler()
    direct = handler.metadata(epath.Path(path) / "1" / "default")
    with ocp.CheckpointManager(path, item_handlers=ckptio.orbax.CkptioCheckpointHandler()) as mngr:
        fresh = mngr.item_metadata(1)
        assert mngr.metadata(1).item_metadata is not None
    for what, meta in (("handler", direct), ("same manager", same_manager), ("fresh manager", fresh)):
        assert meta is not None, what
        assert meta.custom_metadata == {"foo": 1}, what
        tree = meta.tree
        assert isinstance(tree["w"], value_metadata.ArrayMetadata), what
        assert tree["w"].shape == (8, 8) and tree["w"].dtype == np.float32, what
        assert tree["w"].storage.write_shape == (2, 4) and tree["v"].storage.write_shape == (2,), what
        assert tree["n"].storage.write_shape == (2, 3) and tree["n"].dtype == np.int64, what
        assert isinstance(tree["step"], value_metadata.ScalarMetadata) and tree["step"].dtype == np.int64
        assert isinstance(tree["lr"], value_metadata.ScalarMetadata) and tree["lr"].dtype == np.float64
        assert isinstance(tree["name"], value_metadata.StringMetadata), what
        assert meta["w"].shape == (8, 8), what  # indexes like the tree, as Orbax's does
        jax.tree.map(lambda m: m.name, meta)  # a pytree of metadata leaves, as Orbax's
    # The metadata is a restore target, as in Orbax (arrays as saved, on the default device / numpy).
    with ocp.CheckpointManager(path) as mngr:
        out = mngr.restore(1, args=ckptio.orbax.Restore(direct))
    equal(out["w"], np.asarray(state["w"]), "restore onto metadata")
    equal(out["n"], state["n"], "restore onto metadata")
    assert out["step"] == 7 and out["name"] == "run"
    # register(): Orbax's StandardCheckpointHandler reports ckptio's arrays with their storage metadata.
    ckptio.orbax.register()
    try:
        path = epath.Path(root) / "standard"
        arrays = {"w": state["w"], "v": state["v"]}
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ocp.args.StandardSave(arrays, custom_metadata={"bar": 2}))
        meta = ocp.StandardCheckpointHandler().metadata(path)
        assert meta.custom_metadata == {"bar": 2}
        assert meta.tree["w"].storage.write_shape == (2, 4) and meta.tree["v"].storage.write_shape == (2,)
        assert meta.tree["w"].sharding is not None and meta.tree["w"].shape == (8, 8)
        mpath = os.path.join(root, "manager")
        with ocp.CheckpointManager(mpath) as mngr:
            mngr.save(1, args=ocp.args.StandardSave(arrays))
            mngr.wait_until_finished()
            assert mngr.item_metadata(1).tree["w"].storage.write_shape == (2, 4)
    finally:
        ckptio.orbax.unregister()


@scenario
def topology_mismatch(root: str) -> None:
    """Orbax's test_topology_mismatch: a restore without a target, jax.devices() mocked down to one device."""
    mesh = jax.make_mesh((8,), ("x",))
    arr = put(np.arange(8.0, dtype=np.float32), mesh, P("x"))
    one = SingleDeviceSharding(jax.devices()[0])
    ckptio.orbax.register()
    try:
        path = epath.Path(root) / "standard"
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ocp.args.StandardSave({"a": arr}))
            with mock.patch.object(jax, "devices", return_value=jax.devices()[:1]):
                raises(partial(ckptr.restore, path), "Topology mismatch detected", what="StandardRestore()")
                # With a target there is no mismatch: onto the one device asked for.
                target = {"a": jax.ShapeDtypeStruct((8,), np.float32, sharding=one)}
                out = ckptr.restore(path, args=ocp.args.StandardRestore(target))
            equal(out["a"], np.asarray(arr), "with a target")
            assert out["a"].sharding == one
        path = epath.Path(root) / "pytree"
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            ckptr.save(path, args=ocp.args.PyTreeSave({"a": arr}))
            with mock.patch.object(jax, "devices", return_value=jax.devices()[:1]):
                # PyTreeRestore without restore_args: the saved sharding, which this topology lacks.
                raises(partial(ckptr.restore, path), "a:", what="PyTreeRestore()")
    finally:
        ckptio.orbax.unregister()
    # Save/Restore records no topology: Restore() brings jax leaves whole onto the default device,
    # which any topology has (README, Orbax section) -- so there is no mismatch to detect.
    path = os.path.join(root, "save")
    with ocp.CheckpointManager(path) as mngr:
        mngr.save(1, args=ckptio.orbax.Save({"a": arr}))
        mngr.wait_until_finished()
        with mock.patch.object(jax, "devices", return_value=jax.devices()[:1]):
            out = mngr.restore(1, args=ckptio.orbax.Restore())
    equal(out["a"], np.asarray(arr), "Save/Restore, no target")
    assert len(out["a"].sharding.device_set) == 1


#: What a stock restore of a register() item must say (ckptio.orbax._marker.MARKER_MESSAGE's gist).
CALL_REGISTER = "call ckptio.orbax.register()"

#: Run in a fresh process: stock Orbax, ckptio not imported, then imported without register().
STOCK_READER = r"""
import sys
import jax, numpy as np, orbax.checkpoint as ocp
path = sys.argv[1]
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
target = {"w": jax.ShapeDtypeStruct((16,), np.float32, sharding=one), "n": 0, "v": np.zeros(3, np.int64)}
for step in ("no ckptio", "import ckptio.orbax"):
    if step != "no ckptio":
        import ckptio.orbax  # registers nothing for jax.Array: only the typestr answers
    assert "ckptio.orbax" in sys.modules or step == "no ckptio"
    for how, args in (("target", ocp.args.StandardRestore(target)), ("no target", ocp.args.StandardRestore())):
        if step == "no ckptio" and how == "no target":
            continue  # Orbax: Unknown type "ckptio.jax.Array" -- it names ckptio; nothing of ours ran
        try:
            with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
                c.restore(path, args=args)
            print(f"{step}/{how}: restored")
        except Exception as e:
            print(f"{step}/{how}: {type(e).__name__}: {e}")
"""


@scenario
def stock_reads_register_item(root: str) -> None:
    """Issue 16: an item written under register(), read by stock Orbax, fails saying to call register().

    Was: ``NOT_FOUND ... Metadata at "w/.zarray" in OCDBT database ... does not exist`` (with a
    target) or ``Unknown type: "ckptio.jax.Array"`` (without). Covers OCDBT items with only jax
    leaves (no Orbax data at all) and mixed with numpy/scalar leaves, and a non-OCDBT item; and a
    process without ckptio imported. register() still restores them, and Orbax no longer warns
    "Skipping merge of OCDBT checkpoints" on every all-jax save.
    """
    mesh = mesh8()
    w = put(np.arange(16, dtype=np.float32), mesh, P("x"))
    target = {"w": jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P("x")))}
    cases = {
        "jax_only": ({"w": w}, ocp.StandardCheckpointHandler, {}),
        "mixed": ({"w": w, "n": 7, "v": np.arange(3)}, ocp.StandardCheckpointHandler, {}),
        "no_ocdbt": ({"w": w}, ocp.PyTreeCheckpointHandler, {"use_ocdbt": False}),
    }
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    collect = Collect(logging.WARNING)
    logging.getLogger("absl").addHandler(collect)
    ckptio.orbax.register()
    try:
        for name, (state, handler, kw) in cases.items():
            path = epath.Path(root) / name
            with ocp.Checkpointer(handler(**kw)) as c:
                save = ocp.args.StandardSave if handler is ocp.StandardCheckpointHandler else ocp.args.PyTreeSave
                c.save(path, args=save(state))
    finally:
        logging.getLogger("absl").removeHandler(collect)
        ckptio.orbax.unregister()
    # (Orbax warns so for any non-OCDBT item, stock too: only the OCDBT ones must be quiet.)
    skipped = [m for m in warnings if "Skipping merge" in m and "no_ocdbt" not in m]
    assert not skipped, skipped
    # In this process, after unregister(): Orbax's own jax.Array handler, given a target.
    for name, (state, handler, kw) in cases.items():
        path = epath.Path(root) / name
        want = {**target, **{k: v for k, v in state.items() if k != "w"}}
        with ocp.Checkpointer(handler(**kw)) as c:
            if handler is ocp.StandardCheckpointHandler:
                args: Any = ocp.args.StandardRestore(want)
            else:
                restore_args = {"w": ocp.ArrayRestoreArgs(sharding=target["w"].sharding)}
                args = ocp.args.PyTreeRestore(want, restore_args=restore_args)
            raises(partial(c.restore, path, args=args), CALL_REGISTER, what=f"{name}, stock")
    # register() again: every case restores bit-exact (the marker is never read).
    ckptio.orbax.register()
    try:
        for name, (state, handler, kw) in cases.items():
            path = epath.Path(root) / name
            with ocp.Checkpointer(handler(**kw)) as c:
                if handler is ocp.StandardCheckpointHandler:
                    out = c.restore(path, args=ocp.args.StandardRestore({**state, "w": target["w"]}))
                else:
                    restore_args = {"w": ocp.ArrayRestoreArgs(sharding=target["w"].sharding)}
                    out = c.restore(path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
            equal(out["w"], np.asarray(w), f"{name}, register()")
    finally:
        ckptio.orbax.unregister()
    # A fresh process, one device: stock Orbax without ckptio, then with ckptio.orbax imported.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", STOCK_READER, str(epath.Path(root) / "mixed")],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("no ckptio/", "import ckptio"))]
    assert len(lines) == 3, proc.stdout + proc.stderr[-3000:]
    for line in lines:
        assert CALL_REGISTER in line and "restored" not in line, line


@scenario
def manager_root_is_a_file(root: str) -> None:
    """Issue 16: ckptio.orbax.CheckpointManager on a path that is a regular file raises at once, naming it.

    Was: accepted; the first save failed in a background thread with
    ``NotADirectoryError: .../0.orbax-checkpoint-tmp`` and left Orbax's signalling threads waiting.
    """
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "not_a_dir")
    with open(path, "w") as f:
        f.write("x")
    for kw in ({}, {"storage": "mem://file_root"}):
        try:
            ckptio.orbax.CheckpointManager(path, **kw)
        except NotADirectoryError as e:
            assert path in str(e) and "not a directory" in str(e), str(e)
        else:
            raise AssertionError(f"no error for a file root ({kw})")
    # A directory, existing or not, is still fine.
    with ckptio.orbax.CheckpointManager(os.path.join(root, "fresh")) as m:
        m.save(0, args=ckptio.orbax.Save({"a": np.arange(3)}))
        m.wait_until_finished()
        assert m.all_steps() == [0]


if __name__ == "__main__":
    base.main()
