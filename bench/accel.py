"""``ckptio bench --accel``: a state that lives on the default JAX device, saved and restored while a
jitted step runs -- ckptio natively, ckptio under Orbax, stock Orbax, side by side.

Per case (medians of the rounds after a warm-up round; every save of fresh arrays, ``x + 1``,
so that no host copy jax cached on an array serves the next save):

- ``stall_s``: how long the save call holds the training loop (what the step waits for);
- ``commit_s``: from the save call to its commit; ``save_gibs`` the state's size over it;
- ``step_x``: the median step time while the save finishes in the background, over the median step
  time just before it (1.00: the save costs the step nothing);
- ``restore_s`` / ``restore_gibs``: a restore onto the device, as saved, bit-exact checked;
- ``rss_mib``: this process's peak host RSS during the case, above its RSS before it.

Floors, on the same arrays: ``d2h_s`` (``jax.device_get`` of the state: what a host snapshot costs)
and ``device_copy_s`` (a copy of every array on its device, waited for). ``--accel-headroom F``
first fills the device until only ``F`` times the state's size is free (a model larger than the
memory it leaves), to show what a save does with part of the state snapshot on the device.

Only public API is used (``ckptio.CheckpointManager``, ``ckptio.orbax``, Orbax's managers), so the
same file measures an older ckptio tree side by side with this one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["CASES", "render_accel", "run_accel"]

CASES = ("ckptio", "ckptio-host", "ckptio-orbax", "orbax", "raw-disk")


def _jax() -> Any:
    import jax

    return jax


def make_state(size: int, arrays: int, seed: int = 0) -> dict[str, Any]:
    """``arrays`` float32 arrays of about ``size`` bytes in all, on the default device."""
    jax = _jax()
    n = max(1, size // arrays // 4)
    cols = 1024 if n >= 1024 else n
    rows = max(1, n // cols)
    key = jax.random.PRNGKey(seed)
    return {f"w{i:03d}": jax.random.normal(jax.random.fold_in(key, i), (rows, cols), "float32") for i in range(arrays)}


def _fresh(state: dict[str, Any]) -> dict[str, Any]:
    jax = _jax()
    out = _bump(state)
    jax.block_until_ready(out)
    return out


_bump_fn: Any = None


def _bump(state: dict[str, Any]) -> dict[str, Any]:
    global _bump_fn
    if _bump_fn is None:
        jax = _jax()
        # Donated: the old arrays' memory is the new ones' (a 6 GiB state fits a 16 GiB chip once, not twice).
        _bump_fn = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)
    return _bump_fn(state)  # type: ignore[no-any-return]


class Stepper:
    """A jitted bf16 step of about ``ms`` milliseconds on the device, timed one at a time."""

    def __init__(self, ms: float = 6.0) -> None:
        jax = _jax()
        import jax.numpy as jnp

        self.f = jax.jit(lambda a, b: jnp.tanh(a @ b).astype(a.dtype))
        n = 512
        while True:  # grow until a step takes about ``ms``
            self.a = jnp.ones((n, n), jnp.bfloat16)
            self.b = jnp.ones((n, n), jnp.bfloat16) * 0.001
            t = min(self.step() for _ in range(5))
            if t * 1e3 >= ms or n >= 16384:
                break
            n *= 2

    def step(self) -> float:
        t0 = time.perf_counter()
        self.a = self.f(self.a, self.b)
        self.a.block_until_ready()
        return time.perf_counter() - t0


class RssPeak:
    """This process's RSS, sampled every few milliseconds on a thread, as a peak above a baseline."""

    def __init__(self) -> None:
        import psutil

        self._p = psutil.Process()
        self.base = self._p.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._p.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak - self.base


def _abstract(state: dict[str, Any]) -> dict[str, Any]:
    jax = _jax()
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


_print_fn: Any = None


def fingerprint(state: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Per array, two sums of its bits as uint32 (plain, and weighted by position), on the device:
    a bit-exact check that moves nothing to the host."""
    global _print_fn
    jax = _jax()
    if _print_fn is None:
        import jax.numpy as jnp

        def one(x: Any) -> Any:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
            return jnp.stack([jnp.sum(bits), jnp.sum(bits * jnp.arange(1, bits.size + 1, dtype=jnp.uint32))])

        _print_fn = jax.jit(lambda t: jax.tree.map(one, t))
    return {k: (int(v[0]), int(v[1])) for k, v in jax.device_get(_print_fn(state)).items()}


class _Case:
    """One way of saving and restoring: ``save`` returns once the step may go on, ``wait`` until committed."""

    def __init__(self, name: str, root: str) -> None:
        self.name, self.root = name, root
        jax = _jax()
        self.jax = jax
        self._handle: Any = None
        if name == "raw-disk":
            self.mngr = _RawDisk(root)
        elif name.startswith("ckptio") and name != "ckptio-orbax":
            import ckptio

            kw: dict[str, Any] = {}
            if name == "ckptio-host":
                if not hasattr(ckptio, "SaveOptions"):
                    raise NotImplementedError("this ckptio has no SaveOptions (its snapshot is the host's)")
                kw["save_options"] = ckptio.SaveOptions(device_snapshot="host")
            self.mngr: Any = ckptio.CheckpointManager(root, max_to_keep=1, **kw)
        else:
            import orbax.checkpoint as ocp

            registry = None
            if name == "ckptio-orbax":
                import ckptio.orbax

                registry = ckptio.orbax.handler_registry()
            self.ocp = ocp
            options = ocp.CheckpointManagerOptions(max_to_keep=1)
            self.mngr = (ocp.CheckpointManager(root, options=options, handler_registry=registry) if registry
                         else ocp.CheckpointManager(root, options=options))

    def save(self, step: int, state: dict[str, Any]) -> None:
        if self.name == "raw-disk":
            self.mngr.save(step, state)
        elif self.name == "ckptio" or self.name == "ckptio-host":
            self._handle = self.mngr.save(step, state)
        elif self.name == "ckptio-orbax":
            import ckptio.orbax

            self.mngr.save(step, args=ckptio.orbax.Save(state))
        else:
            self.mngr.save(step, args=self.ocp.args.StandardSave(state))

    def done(self) -> bool:
        if self.name == "raw-disk":
            return True
        if self._handle is not None:
            return bool(self._handle.done())
        return not self.mngr.is_saving_in_progress()

    def wait(self) -> None:
        if self.name == "raw-disk":
            return
        if self._handle is not None:
            self._handle.result()
        else:
            self.mngr.wait_until_finished()

    def restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        if self.name == "raw-disk":
            return self.mngr.restore(step, abstract)  # type: ignore[no-any-return]
        if self.name in ("ckptio", "ckptio-host"):
            return self.mngr.restore(step, target=abstract)  # type: ignore[no-any-return]
        if self.name == "ckptio-orbax":
            import ckptio.orbax

            return self.mngr.restore(step, args=ckptio.orbax.Restore(abstract))  # type: ignore[no-any-return]
        return self.mngr.restore(step, args=self.ocp.args.StandardRestore(abstract))  # type: ignore[no-any-return]

    def close(self) -> None:
        self.mngr.close()


class _RawDisk:
    """The disk's own floor: the state to the host (``device_get``), each array written to a file of its
    own and fsync'd, all in the save call; read back and put on the device by the restore."""

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> None:
        d = os.path.join(self.root, str(step))
        shutil.rmtree(os.path.join(self.root, str(step - 1)), ignore_errors=True)
        os.makedirs(d, exist_ok=True)
        for k, v in _jax().device_get(state).items():
            with open(os.path.join(d, k), "wb") as f:
                f.write(memoryview(np.ascontiguousarray(v)).cast("B"))
                os.fsync(f.fileno())

    def restore(self, step: int, abstract: dict[str, Any]) -> dict[str, Any]:
        jax = _jax()
        out = {}
        for k, a in abstract.items():
            host = np.fromfile(os.path.join(self.root, str(step), k), dtype=a.dtype).reshape(a.shape)
            out[k] = jax.device_put(host, a.sharding)
        return out

    def close(self) -> None:
        pass


def _round(case: _Case, step: int, box: list[dict[str, Any]], stepper: Stepper, nbytes: int) -> dict[str, Any]:
    """One save and restore of ``box[0]``, which the round takes (freed before the restore, whose arrays
    then stand in ``box[0]``: a state the device holds once, however large)."""
    state = box.pop()
    jax = _jax()
    want = fingerprint(state)  # checked against, on the device
    before = [stepper.step() for _ in range(10)]
    rss = RssPeak()
    t0 = time.perf_counter()
    case.save(step, state)
    stall = time.perf_counter() - t0
    during: list[float] = []
    while not case.done() and time.perf_counter() - t0 < 600:
        during.append(stepper.step())
    case.wait()
    commit = time.perf_counter() - t0
    abstract = _abstract(state)
    del state
    t1 = time.perf_counter()
    got = case.restore(step, abstract)
    jax.block_until_ready(got)
    restore = time.perf_counter() - t1
    rss_mib = rss.stop() / 2**20
    exact = fingerprint(got) == want
    box.append(got)
    return {"stall_s": stall, "commit_s": commit, "save_gibs": nbytes / 2**30 / commit,
            "step_x": (statistics.median(during) / statistics.median(before)) if during else None,
            "steps_during": len(during), "restore_s": restore, "restore_gibs": nbytes / 2**30 / restore,
            "rss_mib": rss_mib, "bit_exact": exact}


def floors(state: dict[str, Any]) -> tuple[dict[str, float], dict[str, Any]]:
    """The device-to-host copy and the on-device copy of ``state`` (fresh arrays for each; ``state`` is
    consumed), and the state that is left."""
    jax = _jax()
    import jax.numpy as jnp

    state = _fresh(state)
    t0 = time.perf_counter()
    host = jax.device_get(state)
    d2h = time.perf_counter() - t0
    del host
    state = _fresh(state)
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    jax.block_until_ready(copy(state))  # compiled first (its result freed at once)
    t0 = time.perf_counter()
    jax.block_until_ready(copy(state))
    return {"d2h_s": d2h, "device_copy_s": time.perf_counter() - t0}, state


def _ballast(state_bytes: int, fraction: float) -> Any:
    """Fill the default device until ``fraction`` x the state's size stays free (None where it reports no stats)."""
    jax = _jax()
    import jax.numpy as jnp

    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    take = free - int(fraction * state_bytes)
    return jnp.zeros(max(0, take) // 4, jnp.float32) if take > 0 else None


def run_accel(size: int, rounds: int = 3, parent: str | None = None, cases: Sequence[str] = CASES,
              arrays: int = 24, headroom: float | None = None, step_ms: float = 6.0) -> dict[str, Any]:
    """Measure every case of ``cases`` on a state of ``size`` bytes on the default device."""
    jax = _jax()
    device = jax.devices()[0]
    state = make_state(size, arrays)
    nbytes = sum(v.nbytes for v in state.values())
    stepper = Stepper(step_ms)
    ballast = _ballast(nbytes, headroom) if headroom is not None else None
    res: dict[str, Any] = {"device": f"{device.platform}:{getattr(device, 'device_kind', '')}", "bytes": nbytes,
                           "arrays": arrays, "rounds": rounds, "headroom": headroom,
                           "ballast_bytes": int(ballast.nbytes) if ballast is not None else 0,
                           "step_ms": statistics.median(stepper.step() for _ in range(10)) * 1e3,
                           "cases": {}}
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        for name in cases:
            try:
                case = _Case(name, os.path.join(tmp, name))
            except (ImportError, NotImplementedError) as e:
                res["cases"][name] = {"skipped": str(e)}
                continue
            samples, box = [], [state]
            del state
            try:
                for r in range(rounds + 1):  # the first round warms up (compiles, pools, a writer process)
                    box.append(_fresh(box.pop()))
                    samples.append(_round(case, r + 1, box, stepper, nbytes))
            except Exception as e:  # noqa: BLE001 -- a failing case is a row saying why, not a crash
                res["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            finally:
                case.close()
                shutil.rmtree(case.root, ignore_errors=True)
                state = box.pop() if box else make_state(size, arrays)  # a round that failed took it
            res["cases"][name] = _summary(samples)
    del ballast
    # Last: the on-device copy floor raises the device's peak memory, which a save reads as the
    # step's working memory (ckptio.saving.devicecopy.Headroom).
    measured, state = floors(state)
    res.update(measured)
    return res


def _summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    counted = samples[1:] or samples
    out: dict[str, Any] = {"samples": samples, "warmup": samples[0]}
    for key in ("stall_s", "commit_s", "save_gibs", "step_x", "restore_s", "restore_gibs", "rss_mib"):
        vals = [s[key] for s in counted if s[key] is not None]
        out[key] = statistics.median(vals) if vals else None
        out[f"{key}_range"] = [min(vals), max(vals)] if vals else None
    out["bit_exact"] = all(s["bit_exact"] for s in samples)
    return out


def render_accel(res: dict[str, Any]) -> str:
    """The table of :func:`run_accel`'s result."""
    gib = res["bytes"] / 2**30
    head = (f"accelerator: {res['device']}, {gib:.2f} GiB in {res['arrays']} float32 arrays, step "
            f"{res['step_ms']:.1f} ms, {res['rounds']} rounds after a warm-up"
            + (f"; free device memory held to {res['headroom']:g}x the state" if res["headroom"] is not None else ""))
    lines = [head, f"  floors: device->host copy {res['d2h_s']:.3f} s, on-device copy {res['device_copy_s']:.3f} s",
             f"  {'case':<14}{'stall s':>9}{'commit s':>10}{'save GiB/s':>11}{'step x':>8}{'restore GiB/s':>14}"
             f"{'RSS+ MiB':>10}  exact"]
    fmt: Callable[[Any, str], str] = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    for name, c in res["cases"].items():
        if "skipped" in c or "error" in c:
            lines.append(f"  {name:<14}{c.get('skipped') or c.get('error')}")
            continue
        lines.append(f"  {name:<14}{fmt(c['stall_s'], '9.3f')}{fmt(c['commit_s'], '10.2f')}"
                     f"{fmt(c['save_gibs'], '11.2f')}{fmt(c['step_x'], '8.3f')}{fmt(c['restore_gibs'], '14.2f')}"
                     f"{fmt(c['rss_mib'], '10.0f')}  {'yes' if c['bit_exact'] else 'NO'}")
    return "\n".join(lines)
