"""Crash campaign: kill -9 and pause savers, deleters, gc, cp and restorers at random moments.

Each trial runs, at once, a saver (CheckpointManager with retention: it is
also the deleter), a gc looping at ``grace 0`` over the same root, a
``ckptio cp`` of the newest step to a second root, and a restorer restoring
the newest step in a loop and checking it bit-exact. At random moments it
pauses (SIGSTOP) a random subset of them for longer than the lease, resumes
them (SIGCONT), and finally kills a random non-empty subset with SIGKILL
(the others are stopped too). A paused saver is what a lease cannot tell
from a dead one (issue #30): gc deletes its objects, and it must not commit
them afterwards. After each trial, every checkpoint a reader lists (in both
roots) must restore bit-exact, the newest committed step never goes back,
and no ``keep_period`` step once committed is ever lost. At the end a final
gc must leave exactly the kept checkpoints' bytes: no orphan, intent,
tombstone or temporary file.

    python -u tests/scenarios/crash_campaign.py --trials 100 [--root DIR] [--seed N] [--no-pauses] [--keep-going]

``--keep-going`` records a broken invariant and goes on (to count them), instead of stopping there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

LEASE_S = "2"  # short leases, so that the final gc may judge every killed save dead quickly
#: A pause outlives the lease by this much at least: the last heartbeat came up to a quarter lease before.
PAUSE_MARGIN_S = 0.6

CHILD = r"""
import sys, numpy as np, ckptio
from ckptio.saving.writers import sidecar
sys.path.insert(0, {here!r})
from crash_campaign import state_for, as_jax
made = as_jax if {jax} else (lambda state: state)
mngr = ckptio.CheckpointManager({root!r}, max_to_keep=2, keep_period=7, incremental={incremental})
step = (mngr.latest_step() or 0) + 1
print("ready", sidecar.current_pid() or 0, flush=True)  # the writer process, with CKPTIO_WRITER=sidecar
while True:
    try:
        mngr.save(step, made(state_for(step)))
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


RESTORER_CHILD = r"""
import sys, ckptio
sys.path.insert(0, {here!r})
from crash_campaign import same_state
print("ready", flush=True)
while True:
    try:
        got = ckptio.restore({root!r})
    except Exception as e:  # nothing committed yet, or the step went (retention) while being read
        continue
    bad = same_state(got, got["step"])
    if bad:  # only this is reported: it is always wrong, whatever ran beside the read
        print("MISMATCH", got["step"], bad, flush=True)
"""


def state_for(step: int) -> dict:
    """The deterministic state saved at ``step`` (several objects, a few MiB, mixed dtypes)."""
    rng = np.random.default_rng(step)
    return {
        "frozen": np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32),  # never changes
        "params": {f"w{i}": rng.standard_normal((256, 257)).astype(np.float32) for i in range(6)},
        "big": rng.integers(0, 255, size=(5 << 20), dtype=np.uint8),
        "step": step,
        "note": f"step {step}",
    }


def as_jax(state: dict) -> dict:
    """``state`` with its arrays as JAX arrays: the writer process then reads them out of the saver's
    memory (ckptio.saving.writers.remoteread) instead of from shared memory."""
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, state)


def _digest(state: Any) -> str:
    """A digest of the arrays and values of a :func:`state_for`-shaped state (dtypes included)."""
    h = hashlib.sha256(f"{state['step']}|{state['note']}".encode())
    for name in ["big", *(f"params/{k}" for k in sorted(state["params"]))]:
        a = state["big"] if name == "big" else state["params"][name.split("/")[1]]
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


_want: dict[int, str] = {}  # step -> the digest of state_for(step): generating it costs as much as a restore


def same_state(got: Any, step: int) -> str:
    """"" if ``got`` is step ``step``'s state, bit-exact; else what differs."""
    if step not in _want:
        _want[step] = _digest(state_for(step))
    try:
        ok = got["step"] == step and _digest(got) == _want[step]
    except (KeyError, TypeError, AttributeError) as e:
        return f"not a state of this campaign: {e!r}"
    return "" if ok else f"restored step {got.get('step')!r} differs from state_for({step})"


#: Steps restored bit-exact before, per root: a step never changes once committed, so later trials
#: check that its objects are all there with their sizes instead of restoring it again. Restoring
#: every kept step after every trial grew with the root (keep_period steps, and the copy root,
#: which no retention trims): quadratic in the trials.
_verified: dict[str, set[int]] = {}


#: Committed steps of cp's destination left after each trial's checks: cp copies every new step and no
#: retention runs there, so the copy root grew by every step saved (1.3 GiB in 20 trials).
COPIES_KEPT = 6


def trim_copies(dst: str, keep: int = COPIES_KEPT) -> None:
    """Delete all but the newest ``keep`` committed steps of the copy root ``dst`` through the manager
    (with nothing running beside it: between trials), after they were checked."""
    import ckptio

    if os.path.isdir(dst):
        mngr = ckptio.CheckpointManager(dst)
        for step in mngr.all_steps()[:-keep]:
            mngr.delete(step)


def broken_steps(root: str, *, full: bool = False) -> tuple[list[int], dict[int, str]]:
    """The committed steps of ``root``, and those that do not restore bit-exact (with why).

    A step restored bit-exact by an earlier call is checked for its objects only (a deletion is the
    one way it can break), unless ``full``."""
    import ckptio
    from ckptio.engine import run_sync

    if not os.path.isdir(root):
        return [], {}
    mngr = ckptio.CheckpointManager(root)
    verified = _verified.setdefault(root, set())
    broken: dict[int, str] = {}
    try:
        steps = mngr.all_steps()
        for step in steps:
            try:
                if step in verified and not full:
                    m = run_sync(mngr.store.read_manifest(str(step)))
                    run_sync(mngr.store.check_objects(m, f"step {step}"))
                    continue
                bad = same_state(mngr.restore(step), step)
            except Exception as e:  # noqa: BLE001 -- a committed step that does not restore is the finding
                bad = f"{type(e).__name__}: {e}"[:400]
            if bad:
                broken[step] = bad
                verified.discard(step)
            else:
                verified.add(step)
    finally:
        mngr.close()
    return steps, broken


def check(root: str, *, full: bool = False) -> tuple[int, int | None, list[int]]:
    """Every listed checkpoint restores bit-exact; returns (how many, newest, the steps)."""
    steps, broken = broken_steps(root, full=full)
    assert not broken, f"{root}: committed steps that do not restore: {broken}"
    return len(steps), (steps[-1] if steps else None), steps


def _spawn(code: str, writer: str = "thread") -> subprocess.Popen[bytes]:
    env = {**os.environ, "CKPTIO_LEASE_S": LEASE_S, "CKPTIO_WRITER": writer}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _ready(child: subprocess.Popen[bytes]) -> int:
    """Wait for ``child``'s ready line; the pid it names (its sidecar's, or 0)."""
    assert child.stdout is not None
    words = child.stdout.readline().split()
    if words[:1] != [b"ready"]:
        child.kill()
        raise AssertionError(f"child did not start: {child.stderr.read().decode()[-2000:] if child.stderr else ''}")
    return int(words[1]) if len(words) > 1 else 0


def _start(code: str, writer: str = "thread") -> tuple[subprocess.Popen[bytes], int]:
    """A child and the pid its ready line names (its sidecar's, or 0)."""
    child = _spawn(code, writer)
    return child, _ready(child)


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
    from ckptio.manifest.names import REVOKED_DIR, fence_key
    from ckptio.store.fence import writers_of
    from ckptio.store.pins import hold_key, parse_pin, pin_key

    mngr = ckptio.CheckpointManager(root)
    owned: set[str] = set()
    for step in mngr.all_steps():
        m = run_sync_manifest(mngr, step)
        owned.update(os.path.join(root, k) for k in m.keys())  # objects, and a format-2 step's fragments
        owned.add(os.path.join(root, str(step), MANIFEST_NAME))
        # An incremental step's pins on the steps whose objects it references go with it. Many hosts: each
        # host's, under its own save id, on the steps it references (a subset of the root's bases).
        pins = [pin_key(b, str(step), m.checkpoint_id) for b in m.bases or {}]
        if m.fragments is not None:
            savers = writers_of(f.key for f in m.fragments) | {m.checkpoint_id}
            pins = [k for b in m.bases or {} for x in savers
                    if os.path.exists(os.path.join(root, k := pin_key(b, str(step), x)))]
        owned.update(os.path.join(root, k) for k in pins)
        owned.update(os.path.join(root, hold_key(parse_pin(k))) for k in pins)  # and each pin's hold
        if m.fence:  # the commit's fence goes with its step (ckptio.store.fence)
            owned.add(os.path.join(root, fence_key(str(step), m.fence)))
    mngr.close()
    # Revocations are kept forever by design (a revoked save may wake at any time): counted apart.
    revoked = {os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, REVOKED_DIR)) for f in fs}
    on_disk = {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs} - revoked
    stray = sorted(on_disk - owned)
    assert not stray, f"files no kept checkpoint accounts for: {stray[:10]}"
    assert owned <= on_disk, sorted(owned - on_disk)[:10]
    return {"files": len(on_disk), "bytes_on_disk": sum(os.path.getsize(p) for p in on_disk),
            "bytes_of_kept_steps": sum(os.path.getsize(p) for p in owned), "revocations": len(revoked),
            "revocation_bytes": sum(os.path.getsize(p) for p in revoked)}


def run_sync_manifest(mngr: object, step: int) -> object:
    from ckptio.engine import run_sync

    return run_sync(mngr.store.read_manifest(str(step)))  # type: ignore[attr-defined]


def _stopped(pid: int, seconds: float = 5.0) -> bool:
    """Every thread of ``pid`` is stopped (or it has exited) within ``seconds``: its heartbeat too."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:
            return True
        if all(s in ("T", "t", "Z") for s in states):
            return True
        time.sleep(0.005)
    return False


def run_campaign(trials: int, root: str, seed: int = 0, max_delay: float = 1.5, writer: str = "thread", *,
                 pauses: bool = True, keep_going: bool = False, log: Any = None, incremental: bool = False,
                 jax: bool = False) -> dict:
    """``incremental``: the saver's manager saves incrementally (its state has an array that never
    changes). ``jax``: the saver saves JAX arrays (which the writer process reads from its memory).
    ``writer="sidecar"``: the saver writes through its writer process, which is one more thing to
    kill (and pause) -- and which must never outlive its saver.

    ``pauses``: each trial first pauses a random subset of its processes past the lease, up to
    twice, at random moments. ``keep_going``: a broken invariant is recorded in the result's
    ``violations`` and the campaign goes on, instead of raising. ``log``: a callable that gets
    one progress line per trial (e.g. print).
    """
    rnd = random.Random(seed)
    here = os.path.dirname(os.path.abspath(__file__))
    dst = root.rstrip("/") + "-copy"
    codes = {"saver": CHILD.format(here=here, root=root, incremental=incremental, jax=jax),
             "gc": GC_CHILD.format(root=root),
             "cp": CP_CHILD.format(root=root, dst=dst), "restorer": RESTORER_CHILD.format(here=here, root=root)}
    newest_seen: list[int | None] = []
    periodic: set[int] = set()
    roles = [*codes, *(["sidecar"] if writer == "sidecar" else [])]
    kills = dict.fromkeys(roles, 0)
    paused = dict.fromkeys(roles, 0)
    violations: list[str] = []
    seconds: list[float] = []

    def violated(what: str) -> None:
        if not keep_going:
            raise AssertionError(what)
        violations.append(what)
        print("VIOLATION", what, file=sys.stderr, flush=True)  # as it happens: a long run may be cut

    for trial in range(trials):
        t0 = time.monotonic()
        spawned = {name: _spawn(code, writer) for name, code in codes.items()}  # they import at once
        started = {name: (c, _ready(c)) for name, c in spawned.items()}
        children = {name: c for name, (c, _pid) in started.items()}
        pids = {name: c.pid for name, c in children.items()}
        if writer == "sidecar":
            pids["sidecar"] = started["saver"][1]
        t_started = time.monotonic()
        for _ in range(rnd.randint(1, 2) if pauses else 0):
            time.sleep(rnd.uniform(0.0, max_delay))
            frozen = rnd.sample(sorted(pids), rnd.randint(1, len(pids)))
            for name in frozen:  # a VM pause, swap, a stopped container: longer than the lease
                os.kill(pids[name], signal.SIGSTOP)
                paused[name] += 1
            for name in frozen:
                _stopped(pids[name])
            time.sleep(float(LEASE_S) + PAUSE_MARGIN_S + rnd.uniform(0.0, 1.0))
            for name in rnd.sample(frozen, len(frozen)):  # resumed in a random order
                os.kill(pids[name], signal.SIGCONT)
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
        t_ran = time.monotonic()
        out = children["restorer"].stdout.read().decode() if children["restorer"].stdout else ""
        for line in out.splitlines():
            if line.startswith("MISMATCH"):
                violated(f"trial {trial}: the restorer read a wrong state: {line}")
        steps, broken = broken_steps(root)
        copied, broken_copies = broken_steps(dst)
        for where, bad in (("", broken), ("the copy ", broken_copies)):
            for step, why in bad.items():
                violated(f"trial {trial}: {where}step {step} is committed but does not restore: {why}")
        trim_copies(dst)
        good = [s for s in steps if s not in broken]
        newest = good[-1] if good else None
        if newest_seen and newest_seen[-1] is not None and (newest is None or newest < newest_seen[-1]):
            violated(f"trial {trial}: the newest restorable step went back from {newest_seen[-1]} to {newest}")
        newest_seen.append(newest)
        lost = periodic - set(good)
        if lost:
            violated(f"trial {trial}: committed keep_period steps lost: {sorted(lost)}")
        periodic |= {s for s in good if s % 7 == 0}
        t_end = time.monotonic()
        seconds.append(t_end - t0)
        if log is not None:
            log(f"trial {trial}: {t_end - t0:.1f}s (start {t_started - t0:.1f}, run {t_ran - t_started:.1f}, "
                f"check {t_end - t_ran:.1f}: {len(steps)}+{len(copied)} steps) newest {newest} "
                f"killed {sorted(doomed)} violations {len(violations)}")
    # Progress was made, and committed steps only ever move forward.
    seen = [s for s in newest_seen if s is not None]
    assert seen, newest_seen
    import ckptio

    time.sleep(float(LEASE_S) + 0.5)  # every killed save's lease has run out
    os.environ["CKPTIO_LEASE_S"] = LEASE_S
    swept = ckptio.CheckpointManager(root).sweep_orphans(grace_seconds=0)
    if os.path.isdir(dst):
        ckptio.CheckpointManager(dst).sweep_orphans(grace_seconds=0)
    for where in (root, dst):
        for step, why in broken_steps(where, full=True)[1].items():  # every kept step restored once more
            violated(f"after the final gc: {where} step {step} is committed but does not restore: {why}")
    # Nothing a killed save wrote outlives the sweep: no temporary files of interrupted writes,
    # and no file that the committed checkpoints do not account for.
    from ckptio.backends.local import TMP_MARK

    left = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if TMP_MARK in f]
    assert not left, left
    bytes_ = account(root)
    if os.path.isdir(dst):
        account(dst)
    return {"trials": trials, "newest": seen[-1], "swept": len(swept), "kills": kills, "pauses": paused,
            "temporaries": sum(TMP_MARK in k for k in swept), "violations": violations,
            "trial_seconds": {"mean": round(sum(seconds) / len(seconds), 2), "max": round(max(seconds), 2),
                              "first_5": [round(x, 1) for x in seconds[:5]],
                              "last_5": [round(x, 1) for x in seconds[-5:]]}, **bytes_}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--root", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--writer", choices=["thread", "sidecar"], default="thread")
    ap.add_argument("--no-pauses", action="store_true", help="kills only, as before issue #30")
    ap.add_argument("--incremental", action="store_true", help="the saver's manager saves incrementally (#37)")
    ap.add_argument("--keep-going", action="store_true", help="count broken invariants instead of stopping")
    ap.add_argument("--jax", action="store_true",
                    help="the saver saves JAX arrays (the writer process reads them)")
    args = ap.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ckptio-crash-")
    t0 = time.time()
    result = run_campaign(args.trials, root, args.seed, writer=args.writer, pauses=not args.no_pauses,
                          keep_going=args.keep_going, incremental=args.incremental, jax=args.jax,
                          log=lambda line: print(line, flush=True))
    print(result, f"{time.time() - t0:.0f}s", root, flush=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
