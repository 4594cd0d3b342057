"""One process with 4 CPU jax devices (launched by tests/restoring/test_boxexchange.py): a checkpoint saved as
row blocks restored by logical-box exchange onto NamedShardings whose target tables come from the
shardings themselves (no all-gather of boxes). usage: boxexchange_jax_worker.py ROOT"""

from __future__ import annotations

import sys

import numpy as np


def main(root: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ckptio
    from ckptio.coord.distributed import SingleProcess
    from ckptio.engine import run_sync
    from ckptio.restoring import boxexchange
    from ckptio.store import CheckpointStore

    full = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    rows = [((slice(i * 2, i * 2 + 2), slice(None)), full[i * 2 : i * 2 + 2]) for i in range(3)]
    ckptio.save(root, {"w": ckptio.Sharded((6, 10), np.float32, rows)}, step=1).result()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    asked: list[object] = []
    gathered = boxexchange.gathered
    boxexchange.gathered = lambda coord, mine, ndims: (asked.append(mine), gathered(coord, mine, ndims))[1]
    for spec in (P(None, "b"), P("a", "b"), P()):  # columns, blocks, replicated on every device
        target = {"w": jax.ShapeDtypeStruct((6, 10), np.float32, sharding=NamedSharding(mesh, spec))}
        store = CheckpointStore(root)
        step_dir, m = run_sync(store.resolve_manifest(1, shards=False))
        out = boxexchange.restore_exchange(store, m, step_dir, target, SingleProcess())
        assert out["w"].sharding == target["w"].sharding, spec
        assert np.array_equal(np.asarray(out["w"]), full), spec
    assert asked == [{}, {}, {}], asked  # every table came from the sharding
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
