"""Crash campaign: kill -9 savers, deleters, gc and cp at random moments, then check what survives.

Each trial runs, at once, a saver (CheckpointManager with retention: it is
also the deleter), a gc looping at ``grace 0`` over the same root, and a
``ckptio cp`` of the newest step to a second root; then kills a random
non-empty subset of them with SIGKILL (the others are stopped too).
After each kill, every checkpoint a reader lists (in both roots) must
restore bit-exact, the newest committed step never goes back, and no
``keep_period`` step once committed is ever lost. At the end a final gc
must leave exactly the kept checkpoints' bytes: no orphan, intent,
tombstone or temporary file.

    python tests/crash_campaign.py --trials 100 [--root DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

LEASE_S = "2"  # short leases, so that the final gc may judge every killed save dead quickly

CHILD = r"""
import sys, numpy as np, ckptio
from ckptio import sidecar
sys.path.insert(0, {here!r})
from crash_campaign import state_for
mngr = ckptio.CheckpointManager({root!r}, max_to_keep=2, keep_period=7)
step = (mngr.latest_step() or 0) + 1
print("ready", sidecar.current_pid() or 0, flush=True)  # the writer process, with CKPTIO_WRITER=sidecar
while True:
    try:
        mngr.save(step, state_for(step))
    except Exception as e:  # a save refused by its commit check (e.g. a stalled heartbeat) is not data loss
        print("save failed:", repr(e), file=sys.stderr, flush=True)
        mngr._pending = None
    step += 1
"""

GC_CHILD = r"""
import ckptio
from ckptio.engine import run_sync
from ckptio.store import CheckpointStore
print("ready", flush=True)
while True:
    store = CheckpointStore({root!r})
    run_sync(store.sweep(0))
    run_sync(store.close())
"""

CP_CHILD = r"""
import ckptio.cli, sys
print("ready", flush=True)
while True:
    try:
        ckptio.cli.main(["cp", {root!r}, {dst!r}])
    except SystemExit:
        pass
    except Exception as e:  # no committed step yet, or a step deleted under the copy: try again
        print("cp:", repr(e), file=sys.stderr, flush=True)
"""


def state_for(step: int) -> dict:
    """The deterministic state saved at ``step`` (several objects, a few MiB, mixed dtypes)."""
    rng = np.random.default_rng(step)
    return {
        "params": {f"w{i}": rng.standard_normal((256, 257)).astype(np.float32) for i in range(6)},
        "big": rng.integers(0, 255, size=(5 << 20), dtype=np.uint8),
        "step": step,
        "note": f"step {step}",
    }


def check(root: str) -> tuple[int, int | None, list[int]]:
    """Every listed checkpoint restores bit-exact; returns (how many, newest, the steps)."""
    import ckptio

    if not os.path.isdir(root):
        return 0, None, []
    mngr = ckptio.CheckpointManager(root)
    steps = mngr.all_steps()
    for step in steps:
        got = mngr.restore(step)
        want = state_for(step)
        assert got["step"] == step and got["note"] == want["note"], step
        assert got["big"].tobytes() == want["big"].tobytes(), step
        for k, v in want["params"].items():
            assert got["params"][k].tobytes() == v.tobytes(), (step, k)
    mngr.close()
    return len(steps), (steps[-1] if steps else None), steps


def _start(code: str, writer: str = "thread") -> tuple[subprocess.Popen[bytes], int]:
    """A child and the pid its ready line names (its sidecar's, or 0)."""
    env = {**os.environ, "CKPTIO_LEASE_S": LEASE_S, "CKPTIO_WRITER": writer}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert child.stdout is not None
    words = child.stdout.readline().split()
    if words[:1] != [b"ready"]:
        child.kill()
        raise AssertionError(f"child did not start: {child.stderr.read().decode()[-2000:] if child.stderr else ''}")
    return child, int(words[1]) if len(words) > 1 else 0


def _gone(pid: int, seconds: float = 30.0) -> bool:
    """``pid`` has exited (a zombie counts: it runs nothing) within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def account(root: str) -> dict[str, int]:
    """Bytes on disk under ``root`` against the bytes its kept checkpoints account for."""
    import ckptio
    from ckptio.manifest import MANIFEST_NAME

    mngr = ckptio.CheckpointManager(root)
    owned: set[str] = set()
    for step in mngr.all_steps():
        m = run_sync_manifest(mngr, step)
        owned.update(os.path.join(root, k) for k in m.keys())  # objects, and a format-2 step's fragments
        owned.add(os.path.join(root, str(step), MANIFEST_NAME))
    mngr.close()
    on_disk = {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}
    stray = sorted(on_disk - owned)
    assert not stray, f"files no kept checkpoint accounts for: {stray[:10]}"
    assert owned <= on_disk, sorted(owned - on_disk)[:10]
    return {"files": len(on_disk), "bytes_on_disk": sum(os.path.getsize(p) for p in on_disk),
            "bytes_of_kept_steps": sum(os.path.getsize(p) for p in owned)}


def run_sync_manifest(mngr: object, step: int) -> object:
    from ckptio.engine import run_sync

    return run_sync(mngr.store.read_manifest(str(step)))  # type: ignore[attr-defined]


def run_campaign(trials: int, root: str, seed: int = 0, max_delay: float = 1.5, writer: str = "thread") -> dict:
    """``writer="sidecar"``: the saver writes through its writer process, which is one more
    thing to kill -- and which must never outlive its saver."""
    rnd = random.Random(seed)
    here = os.path.dirname(os.path.abspath(__file__))
    dst = root.rstrip("/") + "-copy"
    codes = {"saver": CHILD.format(here=here, root=root), "gc": GC_CHILD.format(root=root),
             "cp": CP_CHILD.format(root=root, dst=dst)}
    newest_seen: list[int | None] = []
    periodic: set[int] = set()
    kills = {name: 0 for name in [*codes, *(["sidecar"] if writer == "sidecar" else [])]}
    for _ in range(trials):
        started = {name: _start(code, writer) for name, code in codes.items()}
        children = {name: c for name, (c, _pid) in started.items()}
        pids = {name: c.pid for name, c in children.items()}
        if writer == "sidecar":
            pids["sidecar"] = started["saver"][1]
        time.sleep(rnd.uniform(0.0, max_delay))
        doomed = rnd.sample(sorted(pids), rnd.randint(1, len(pids)))
        for name in doomed:  # the kills land at once, in a random order
            os.kill(pids[name], signal.SIGKILL)
            kills[name] += 1
        for child in children.values():  # the survivors are stopped too (then killed: no clean exit path)
            child.kill()
            child.wait()
        if writer == "sidecar":
            assert _gone(pids["sidecar"]), f"the sidecar {pids['sidecar']} outlived its killed saver"
        _count, newest, steps = check(root)
        check(dst)
        newest_seen.append(newest)
        lost = periodic - set(steps)
        assert not lost, f"committed keep_period steps lost: {sorted(lost)}"
        periodic |= {s for s in steps if s % 7 == 0}
    # Progress was made, and committed steps only ever move forward.
    seen = [s for s in newest_seen if s is not None]
    assert seen and seen == sorted(seen), newest_seen
    import ckptio

    time.sleep(float(LEASE_S) + 0.5)  # every killed save's lease has run out
    os.environ["CKPTIO_LEASE_S"] = LEASE_S
    swept = ckptio.CheckpointManager(root).sweep_orphans(grace_seconds=0)
    if os.path.isdir(dst):
        ckptio.CheckpointManager(dst).sweep_orphans(grace_seconds=0)
    check(root)
    # Nothing a killed save wrote outlives the sweep: no temporary files of interrupted writes,
    # and no file that the committed checkpoints do not account for.
    from ckptio.backends.local import TMP_MARK

    left = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if TMP_MARK in f]
    assert not left, left
    bytes_ = account(root)
    if os.path.isdir(dst):
        account(dst)
    return {"trials": trials, "newest": seen[-1], "swept": len(swept), "kills": kills,
            "temporaries": sum(TMP_MARK in k for k in swept), **bytes_}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--root", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--writer", choices=["thread", "sidecar"], default="thread")
    args = ap.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptio-crash-")
    t0 = time.time()
    print(run_campaign(args.trials, root, args.seed, writer=args.writer), f"{time.time() - t0:.0f}s", root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
