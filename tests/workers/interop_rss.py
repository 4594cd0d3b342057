"""Peak RSS of streaming conversions of a large checkpoint, each in a fresh process.

usage: interop_rss.py WORKDIR [--gib 2] [--tensors 16]

1. (not measured) stock ``dcp.save`` of ``--gib`` GiB in ``--tensors`` float32 tensors -> WORKDIR/dcp
2. each conversion in its own process, which reports its peak RSS (``ru_maxrss``: imports
   included) and its RSS right after importing its framework (the baseline):
   dcp -> ckptio, ckptio -> dcp, ckptio -> orbax, orbax -> ckptio
3. (not measured) spot checks, bit-exact: two tensors after every hop, loaded by ckptio or stock
   DCP, against digests taken when they were made.

At most two checkpoints exist at once (each is deleted once no later hop reads it): the
test suite runs on machines with a few GiB of disk to spare.

Prints one JSON line: ``{"gib": ..., "conversions": [{"name", "peak_rss_mib", "baseline_rss_mib",
"seconds", "gib_per_s"}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make(work: str, gib: float, n: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    cols = 4096
    rows = int(gib * 2**30 / 4 / cols / n)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-(2**31), 2**31 - 1, (rows, cols), dtype=torch.int32, generator=g)
    sd = {}
    for i in range(n):
        t = base.clone()
        t ^= i
        sd[f"t{i:02d}"] = t.view(torch.float32)
    sd["step"] = 1000
    dcp.save(sd, checkpoint_id=os.path.join(work, "dcp"), no_dist=True)
    digests = {k: _digest(sd[k].numpy()) for k in CHECKED}
    with open(os.path.join(work, "digests.json"), "w") as f:
        json.dump({"shape": [rows, cols], "digests": digests}, f)


CHECKED = ("t00", "t07")


def _digest(a: object) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).data).hexdigest()


def child(name: str, src: str, dst: str) -> None:
    src_format, dst_format = name.split("-to-")
    if "dcp" in name:
        import torch  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
    if "orbax" in name:
        import jax  # noqa: F401
        import orbax.checkpoint  # noqa: F401
    from ckptio.convert import convert

    base = _rss_mib()
    t0 = time.perf_counter()
    res = convert(src, dst, src_format=src_format, dst_format=dst_format)
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "name": name,
                "peak_rss_mib": round(_rss_mib(), 1),
                "baseline_rss_mib": round(base, 1),
                "seconds": round(dt, 2),
                "gib": round(res.bytes / 2**30, 3),
                "gib_per_s": round(res.bytes / 2**30 / dt, 3),
            }
        )
    )


def check(work: str, fmt: str, path: str) -> None:
    """The checked tensors of the ``fmt`` checkpoint at ``path`` are bit-exact the ones made."""
    with open(os.path.join(work, "digests.json")) as f:
        made = json.load(f)
    for name in CHECKED:
        if fmt == "dcp":
            import torch
            import torch.distributed.checkpoint as dcp

            from ckptio.state.leaves import torch_to_numpy

            sd = {name: torch.zeros(made["shape"], dtype=torch.float32)}
            dcp.load(sd, checkpoint_id=path, no_dist=True)
            got = torch_to_numpy(sd[name])
        else:
            import ckptio

            got = ckptio.restore(path, target={name: None})[name]
        assert _digest(got) == made["digests"][name], (path, name)
    print(json.dumps({"check": path}))


#: (conversion, source, destination, what to delete after it); orbax's copy is checked by the
#: hop that reads it back.
STEPS = [
    ("dcp-to-ckptio", "dcp", "ckptio", ("dcp",)),
    ("ckptio-to-dcp", "ckptio", "dcp2", ("dcp2",)),
    ("ckptio-to-orbax", "ckptio", "orbax", ("ckptio",)),
    ("orbax-to-ckptio", "orbax", "ckptio2", ("orbax", "ckptio2")),
]


def main() -> None:
    if sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    if sys.argv[1] == "--make":
        make(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
        return
    if sys.argv[1] == "--check":
        check(*sys.argv[2:5])
        return
    work = sys.argv[1]
    args = dict(zip(sys.argv[2::2], sys.argv[3::2]))
    gib, n = float(args.get("--gib", 2)), int(args.get("--tensors", 16))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, __file__, "--make", work, str(gib), str(n)], check=True, env=env)
    rows = []
    for name, src, dst, done in STEPS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, os.path.join(work, src), os.path.join(work, dst)],
            check=True,
            env=env,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
        if dst != "orbax":
            fmt = "dcp" if dst.startswith("dcp") else "ckptio"
            subprocess.run([sys.executable, __file__, "--check", work, fmt, os.path.join(work, dst)],
                           check=True, env=env, stdout=subprocess.DEVNULL)
        for d in done:
            shutil.rmtree(os.path.join(work, d))
    print(json.dumps({"gib": gib, "tensors": n, "conversions": rows}))


if __name__ == "__main__":
    main()
