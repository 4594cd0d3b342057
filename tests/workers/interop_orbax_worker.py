"""Orbax side of the interop tests, on 8 CPU devices (a 4x2 mesh); run in a subprocess.

usage: interop_orbax_worker.py WORKDIR SCENARIO...   (verdicts -> WORKDIR/results.json)

scenarios:
  adapter_local    ckptio.orbax saves the 4x2 state in WORKDIR/adapter_local (step 1, small checksum blocks)
  adapter_gcs      the same, data in $INTEROP_GCS_URL (fake GCS), Orbax directory WORKDIR/adapter_gcs
  stock_roundtrip  stock StandardCheckpointer -> `ckptio convert` -> ckptio -> `ckptio convert` -> stock
                   restore, bit-exact (no target, and resharded onto 2x4); also ckptio.orbax's -> stock
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(TESTS, "support"))  # interop_data

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import interop_data as D  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptio  # noqa: E402
import ckptio.orbax  # noqa: E402
from ckptio.cli import main as cli  # noqa: E402

WORK = sys.argv[1]


def mesh(shape: tuple[int, int] = (4, 2)) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("x", "y"))


def state() -> dict[str, Any]:
    m = mesh()
    out: dict[str, Any] = {}
    for name, arr in D.orbax_arrays().items():
        node = out
        *head, last = name.split("/")
        for h in head:
            node = node.setdefault(h, {})
        node[last] = jax.device_put(arr, NamedSharding(m, P(*D.ORBAX_ARRAYS[name][2])))
    out["count"] = jnp.int32(3)
    out["np"] = np.arange(6, dtype=np.int16).reshape(2, 3)
    out["step"] = 7
    out["lr"] = 0.25
    return out


def bits(x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        return (str(a.dtype), a.shape, a.tobytes())
    return (type(x).__name__, x)


def assert_same(got: Any, want: Any, what: str) -> None:
    g, gt = jax.tree_util.tree_flatten_with_path(got)
    w, wt = jax.tree_util.tree_flatten_with_path(want)
    assert gt == wt, f"{what}: structure differs:\n{gt}\n{wt}"
    for (path, a), (_, b) in zip(g, w):
        assert bits(a) == bits(b), (
            f"{what}: {jax.tree_util.keystr(path)} differs: {bits(a)[:2]} vs {bits(b)[:2]}"
        )


def on_mesh(tree: Any, m: jax.sharding.Mesh) -> Any:
    """Abstract target: every jax array on ``m``, split over 'y' then 'x' where the dims allow."""

    def leaf(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        axes = [a if i < x.ndim and x.shape[i] % m.shape[a] == 0 else None for i, a in enumerate(("y", "x"))]
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(*axes[: x.ndim])))

    return jax.tree_util.tree_map(leaf, tree)


def run_cli(*argv: str) -> dict[str, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(list(argv))
    out = buf.getvalue()
    assert rc == 0, f"ckptio {' '.join(argv)} exited {rc}: {out}"
    return json.loads(out)


def adapter_save(root: str, storage: str | None) -> None:
    registry = ckptio.orbax.handler_registry(storage, engine_config=ckptio.EngineConfig(block_size=D.BLOCK))
    with ocp.CheckpointManager(root, handler_registry=registry) as mngr:
        mngr.save(1, args=ckptio.orbax.Save(state()))
        mngr.wait_until_finished()


def adapter_local() -> None:
    adapter_save(os.path.join(WORK, "adapter_local"), None)


def adapter_gcs() -> None:
    adapter_save(os.path.join(WORK, "adapter_gcs"), os.environ["INTEROP_GCS_URL"])


def stock_roundtrip() -> None:
    st = state()
    src, mid, out = (os.path.join(WORK, n) for n in ("stock", "stock_ckptio", "stock_back"))
    ck = ocp.StandardCheckpointer()
    ck.save(src, st)
    ck.wait_until_finished()
    res = run_cli("convert", src, mid, "--from", "orbax", "--to", "ckptio", "--json")
    assert res["ok"] and res["items"] == 8, res
    native = ckptio.restore(mid)
    for name, arr in D.orbax_arrays().items():
        parts = name.split("/")
        node = native
        for p in parts:
            node = node[p]
        assert D.same_bits(node, arr), name
    assert native["step"] == 7 and native["lr"] == 0.25 and native["np"].dtype == np.int16
    # The converted checkpoint keeps Orbax's chunks (its saved shards) as its shards.
    inspect = run_cli("inspect", mid, "--json")
    assert len(inspect["items"]["params/w"]["shards"]) == 8, inspect["items"]["params/w"]
    # ckptio restores it resharded too (jax targets on a 2x4 mesh).
    target = on_mesh(st, mesh((2, 4)))
    got = ckptio.restore(mid, target={k: v for k, v in target.items() if k in ("params", "emb")})
    assert got["params"]["w"].sharding == target["params"]["w"].sharding
    assert D.same_bits(got["emb"], D.orbax_arrays()["emb"])

    res = run_cli("convert", mid, out, "--from", "ckptio", "--to", "orbax", "--json")
    assert res["ok"], res
    back = ocp.StandardCheckpointer().restore(out)  # stock code, no target
    assert_same(back, st, "stock restore, no target")
    assert isinstance(back["params"]["w"], jax.Array) and isinstance(back["np"], np.ndarray)
    back = ocp.StandardCheckpointer().restore(out, target)  # stock code, resharded onto 2x4
    assert_same(back, st, "stock restore, 2x4 target")
    assert back["params"]["w"].sharding == target["params"]["w"].sharding

    # A checkpoint saved by ckptio.orbax (4x2 mesh) -> Orbax's own layout -> stock restore.
    adapter_local()
    item = os.path.join(WORK, "adapter_local", "1", "default")
    res = run_cli(
        "convert", item, os.path.join(WORK, "adapter_back"), "--from", "ckptio", "--to", "orbax", "--json"
    )
    back = ocp.StandardCheckpointer().restore(os.path.join(WORK, "adapter_back"), target)
    assert_same(back, st, "ckptio.orbax -> Orbax layout -> stock restore")

    # PyTree checkpoints hold strings too.
    tree = {"a": jnp.arange(5, dtype=jnp.float32), "name": "run-1", "n": 3}
    ocp.PyTreeCheckpointer().save(os.path.join(WORK, "pytree"), tree)
    run_cli(
        "convert",
        os.path.join(WORK, "pytree"),
        os.path.join(WORK, "pytree_c"),
        "--from",
        "orbax",
        "--to",
        "ckptio",
        "--json",
    )
    assert ckptio.restore(os.path.join(WORK, "pytree_c"))["name"] == "run-1"
    run_cli(
        "convert",
        os.path.join(WORK, "pytree_c"),
        os.path.join(WORK, "pytree_b"),
        "--from",
        "ckptio",
        "--to",
        "orbax",
        "--json",
    )
    assert_same(
        ocp.PyTreeCheckpointer().restore(os.path.join(WORK, "pytree_b")), tree, "pytree with a string"
    )


SCENARIOS = {f.__name__: f for f in (adapter_local, adapter_gcs, stock_roundtrip)}


def main() -> None:
    results: dict[str, str] = {}
    for name in sys.argv[2:]:
        try:
            SCENARIOS[name]()
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - the verdict carries it
            results[name] = traceback.format_exc()
            print(results[name], file=sys.stderr)
        with open(os.path.join(WORK, "results.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
