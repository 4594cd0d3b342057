"""Kill campaign for deterministic resume (issue 34): a real loop, killed again and again, must
see exactly the batches, losses and states of an uninterrupted run.

    python -m ckptio.bench.resume_campaign --kind torch --sigkill 30 --sigterm 10
    python -m ckptio.bench.resume_campaign --kind flax --sigkill 30 --sigterm 10
    python -m ckptio.bench.resume_campaign --cost      # reached_preemption's per-step cost, no notice

Its work directory (checkpoints and logs, under the system's temporary directory) is removed at
the end, unless ``--keep``.

``--kind torch``: torch + torchdata ``StatefulDataLoader`` (2 workers); ``--kind flax``: flax/optax
(a jax pytree with a typed PRNG key) + a grain ``MapDataset`` iterator. The loop saves every
``--every`` steps with a ``CheckpointManager`` (state and data loader in one checkpoint, two kept),
asks ``reached_preemption`` every step, and appends one line per step to a log (the digests of the
batch and the state after the step, and the loss). The driver first runs it uninterrupted (the
reference), then launches it again and again: SIGKILL at a random moment, or SIGTERM (the loop
then saves the agreed step and exits 0, and its next launch must resume exactly there), until the
quotas are spent; then lets it finish. Every line of every launch must match the reference's line
for its step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np


def _digest(tree: Any) -> str:
    from ckptio.state.tree import flatten_named

    h = hashlib.sha256()
    names, leaves, _ = flatten_named(tree)
    for name, leaf in zip(names, leaves):
        if hasattr(leaf, "detach"):
            leaf = leaf.detach().numpy()
        arr = np.asarray(leaf)
        h.update(name.encode() + arr.dtype.str.encode() + str(arr.shape).encode() + arr.tobytes())
    return h.hexdigest()[:20]


def _torch_loop() -> tuple[Any, Any, Any]:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    g = torch.Generator()
    g.manual_seed(1)
    data = StatefulDataLoader(torch.randn(1 << 17, 8), batch_size=16, shuffle=True, num_workers=2, generator=g)

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        w = state["w"].clone().requires_grad_(True)
        loss = ((batch @ w - batch[:, 0]) ** 2).mean()
        loss.backward()
        m = 0.9 * state["m"] + w.grad
        return {"w": (w - 0.01 * m).detach(), "m": m}, float(loss)

    return {"w": torch.zeros(8), "m": torch.zeros(8)}, data, step


def _flax_loop() -> tuple[Any, Any, Any]:
    import grain
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.adam(0.01)
    params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
    ds = grain.MapDataset.range(1 << 17).shuffle(seed=5).map(
        lambda i: np.sin(np.arange(8, dtype=np.float32) * (i % 97))).batch(16)

    @jax.jit
    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, (batch.shape[0],)) * 0.1

        def loss_fn(p: Any) -> Any:
            return jnp.mean((batch @ p["w"] + p["b"] - noise) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        upd, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": o, "key": key}, loss

    return {"params": params, "opt": opt.init(params), "key": jax.random.key(0)}, iter(ds), step


def _save(mngr: Any, step: int, tree: Any, fd: int) -> bool:
    """Save ``step`` if due; False (and a ``save_refused`` line) where ckptio refuses it: a step that an
    earlier launch was killed in the middle of committing cannot be saved again until that save's lease
    ends (ckptio's fencing; ``ckptio gc`` settles it), so a resumed run that gets there again goes on."""
    try:
        return mngr.save(step, tree) is not None
    except FileExistsError:
        os.write(fd, (json.dumps({"save_refused": step}) + "\n").encode())
        return False


def loop(kind: str, root: str, log_path: str, steps: int, every: int, sleep: float) -> int:
    """One launch: resume from the newest checkpoint (if any), then train to ``steps``."""
    import ckptio

    state, data, step_fn = _torch_loop() if kind == "torch" else _flax_loop()
    mngr = ckptio.CheckpointManager(root, save_interval_steps=every, max_to_keep=2)
    start = 0
    if mngr.latest_step() is not None:
        got = mngr.restore(target={"state": ckptio.restore_target(state), "data": data, "step": 0})
        state, start = got["state"], got["step"]
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    mngr.reached_preemption(start)  # SIGTERM is a notice from here on
    os.write(fd, (json.dumps({"resumed": start}) + "\n").encode())
    it = iter(data)
    for s in range(start + 1, steps + 1):
        batch = next(it)
        state, loss = step_fn(state, batch)
        line = {"s": s, "b": _digest(batch), "l": float(loss).hex(), "w": _digest(state)}
        os.write(fd, (json.dumps(line) + "\n").encode())
        time.sleep(sleep)
        if mngr.reached_preemption(s):
            if _save(mngr, s, {"state": state, "data": data, "step": s}, fd):
                mngr.wait_until_finished()
                os.write(fd, (json.dumps({"preempted": s}) + "\n").encode())
            mngr.close()
            return 0
        _save(mngr, s, {"state": state, "data": data, "step": s}, fd)  # on the interval only
    mngr.wait_until_finished()
    os.write(fd, (json.dumps({"done": steps}) + "\n").encode())
    mngr.close()
    return 0


def _lines(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except ValueError:  # a line cut by SIGKILL
                pass
    return out


def _launch(args: argparse.Namespace, root: str, log: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "ckptio.bench.resume_campaign", "--loop", args.kind, root, log,
            str(args.steps), str(args.every), str(args.sleep)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_started(p: subprocess.Popen[bytes], log: str, launches: int) -> bool:
    """Wait until launch number ``launches`` wrote its ``resumed`` line (False: it exited first)."""
    while sum("resumed" in d for d in _lines(log)) < launches:
        if p.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def drive(args: argparse.Namespace) -> int:
    """The campaign (see the module docstring) in a work directory of its own, removed at the end
    (whatever the outcome) unless ``args.keep``."""
    work = tempfile.mkdtemp(prefix=f"resume-campaign-{args.kind}-")
    try:
        return _campaign(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _campaign(args: argparse.Namespace, work: str) -> int:
    ref_log, log = os.path.join(work, "reference.log"), os.path.join(work, "campaign.log")
    t0 = time.time()
    p = _launch(args, os.path.join(work, "reference"), ref_log)
    if p.wait() != 0:
        sys.stderr.write(p.stderr.read().decode()[-4000:] if p.stderr else "")
        return 1
    ref = {d["s"]: d for d in _lines(ref_log) if "s" in d}
    rng = random.Random(args.seed)
    kills = {"SIGKILL": 0, "SIGTERM": 0}
    launches, preempted_ok, problems = 0, 0, []
    root = os.path.join(work, "ckpt")
    while True:
        launches += 1
        p = _launch(args, root, log)
        started = _wait_started(p, log, launches)
        left = {"SIGKILL": args.sigkill - kills["SIGKILL"], "SIGTERM": args.sigterm - kills["SIGTERM"]}
        if not started or not any(v > 0 for v in left.values()):
            rc = p.wait()
            if rc != 0:
                problems.append(f"launch {launches} exited {rc}: {p.stderr.read().decode()[-2000:] if p.stderr else ''}")
            break
        sig = rng.choice([k for k, v in left.items() if v > 0 for _ in range(v)])
        time.sleep(rng.uniform(0.05, args.window))
        if p.poll() is not None:
            continue
        p.send_signal(signal.SIGKILL if sig == "SIGKILL" else signal.SIGTERM)
        rc = p.wait()
        kills[sig] += 1
        if sig == "SIGTERM" and rc != 0:
            problems.append(f"launch {launches}: SIGTERM exit {rc}: {p.stderr.read().decode()[-2000:] if p.stderr else ''}")
    events = _lines(log)
    for prev, nxt in zip(events, events[1:]):  # a preemption save is where the next launch resumes
        if "preempted" in prev:
            if nxt.get("resumed") == prev["preempted"]:
                preempted_ok += 1
            else:
                problems.append(f"preempted at {prev['preempted']}, next launch resumed at {nxt}")
    checked = 0
    for d in events:
        if "s" in d:
            checked += 1
            if d != ref.get(d["s"]):
                problems.append(f"step {d['s']}: {d} != reference {ref.get(d['s'])}")
    done = any("done" in d for d in events)
    report = {"kind": args.kind, "steps": args.steps, "launches": launches, "kills": kills,
              "preemption_saves_resumed_exactly": preempted_ok,
              "saves_refused_after_a_kill_mid_commit": sum("save_refused" in d for d in events), "step_lines_checked": checked,
              "finished": done, "mismatches": len(problems), "seconds": round(time.time() - t0, 1),
              "work": work if args.keep else None}
    print(json.dumps(report))
    for msg in problems[:10]:
        print(msg)
    return 0 if done and not problems else 1


def cost(n: int = 200_000) -> int:
    """reached_preemption per call, no notice, one process (the watcher thread running)."""
    import ckptio

    with tempfile.TemporaryDirectory() as tmp:
        mngr = ckptio.CheckpointManager(tmp)
        mngr.reached_preemption(0)
        t = time.perf_counter()
        for s in range(1, n + 1):
            mngr.reached_preemption(s)
        per = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for s in range(1, n + 1):
            pass
        base = (time.perf_counter() - t) / n
        mngr.close()
    print(json.dumps({"calls": n, "ns_per_call": round(per * 1e9), "ns_empty_loop": round(base * 1e9)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--loop":
        kind, root, log, steps, every, sleep = argv[1:7]
        return loop(kind, root, log, int(steps), int(every), float(sleep))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["torch", "flax"], default="torch")
    ap.add_argument("--sigkill", type=int, default=30)
    ap.add_argument("--sigterm", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.01)
    ap.add_argument("--window", type=float, default=1.5, help="kill within this many seconds of a launch's start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (checkpoints, logs) at the end")
    args = ap.parse_args(argv)
    return cost() if args.cost else drive(args)


if __name__ == "__main__":
    sys.exit(main())
