"""``ckptio bench``: the command line over the harness, reports, sweep and advice.

``main(argv) -> int`` is what ``ckptio bench ...`` and ``python -m ckptio.bench`` call.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ckptio.bench import pinning, report
from ckptio.bench.advise import advise, render_advice
from ckptio.bench.cases import Case, all_cases
from ckptio.bench.cli_ratelimit import add_rate_limit_options, main_rate_limit_args
from ckptio.bench.harness import QUICK_CASES, QUICK_SIZE, quick_note, run_interleaved, run_job, select_cases
from ckptio.bench.spec import Job, StateSpec, format_bytes, parse_duration, parse_size
from ckptio.bench.system import environment
from ckptio.bench.targets import GCSTarget, Target, open_target
from ckptio.engine import gilswitch

__all__ = ["build_parser", "main"]

SCHEMA = "ckptio.bench/1"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(parse_size(t)) if t[-1:].isalpha() else int(t) for t in _csv(text)]


def _error(message: str) -> int:
    """Print ``message`` as the one-line error every ``ckptio`` command prints; the usage exit status."""
    print(f"ckptio: error: {message}", file=sys.stderr)
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse whose errors read like the rest of ``ckptio``'s: one line, no usage dump, exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.exit(_error(f"{message} (see `{self.prog} --help`)"))


def build_parser(prog: str = "ckptio bench") -> argparse.ArgumentParser:
    """The ``ckptio bench`` argument parser (the CLI may embed it as a subcommand)."""
    p = _Parser(
        prog=prog,
        description="Save/restore throughput, stall and memory of ckptio side by side with the raw disk, "
                    "Orbax, DCP, torch.save and tensorstore, on the same generated state.",
    )
    g = p.add_argument_group("state")
    g.add_argument("--size", default=None, help=f"total state size (default 1GiB; the quick set: {QUICK_SIZE})")
    g.add_argument("--arrays", type=int, default=None,
                   help="number of arrays (default 32; 100 for --incremental, so its FRACTION is met to 1 %%)")
    g.add_argument("--dtype", default="float32", help="array dtype: float32, bfloat16, float16, int8, ... ")
    g.add_argument("--rounds", type=int, default=3, help="save+restore rounds per case (default 3)")
    g.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="rounds per case run before the timed ones and shown apart, out of the medians "
                        "(default 1: a first save that allocates staging buffers or imports a library is "
                        "not the steady state; 0: every round counts)")
    g = p.add_argument_group("where")
    g.add_argument("--backend", default=None, metavar="URL",
                   help="where to benchmark: a directory or file://DIR (a temp dir is made inside it, default: "
                        "the system temp dir), or gs://BUCKET/PREFIX: that real bucket, with google-auth's default "
                        "credentials (or the emulator in STORAGE_EMULATOR_HOST, if set)")
    g.add_argument("--fake-gcs", action="store_true",
                   help="benchmark GCS against a local fake-gcs-server the bench starts afresh for every case "
                        "(--backend gs://BUCKET/PREFIX names the bucket; default gs://bench/ckptio-bench)")
    g.add_argument("--dir", default=None, help="parent directory for the local temp dir (default: system temp)")
    g.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    g.add_argument("--cache-drop", default="auto", choices=["auto", "drop_caches", "fadvise", "none"],
                   help="how restores are made cold (auto: drop_caches if permitted, else fadvise)")
    g = p.add_argument_group("what")
    g.add_argument("--full", action="store_true",
                   help="every default case and every ratio table (~12 min at 1GiB here); without it, and without "
                        "--cases, the quick set (its goals, no ratio tables): " + ", ".join(QUICK_CASES))
    g.add_argument("--cases", type=_csv, default=None,
                   help="comma-separated case names/globs (default: every default case; --list shows them)")
    g.add_argument("--skip", type=_csv, default=[], help="comma-separated case names/globs to leave out")
    g.add_argument("--list", action="store_true", help="list the cases and whether they can run here")
    g.add_argument("--no-verify", dest="verify", action="store_false", help="do not check restored bytes")
    g.add_argument("--train", action="store_true",
                   help="keep a GIL-bound training-step loop running in the saving process while each "
                        "asynchronous save finishes, and report how much slower its steps get")
    g.add_argument("--pin", action="store_true",
                   help="with --train: the training thread alone on one core, every other thread and process "
                        "of the case on the others (what a many-core host sees; bench/pinning.py)")
    g.add_argument("--train-window", type=float, default=None, metavar="S",
                   help="with --train: keep timing the step until S seconds from each save's start and report "
                        "its slowdown over that window too (one length of training time for every case, so a "
                        "save that ends sooner is not scored worse for the same loss)")
    g.add_argument("--gil-switch", type=float, default=None, metavar="S",
                   help="the interpreter's switch interval while ckptio's saves run in the background, in seconds "
                        "(sets CKPTIO_GIL_SWITCH_S for every case; 0: leave it; default: ckptio's, 0.0005)")
    g.add_argument("--no-equalize", dest="equalize", action="store_false",
                   help="do not touch and free the restore's worth of memory before each timed restore "
                        "(memory_state: as-is; see bench/README.md)")
    g.add_argument("--interleave", action="store_true",
                   help="run the cases side by side one round at a time (every case's round 1, then every "
                        "round 2, ...), so storage that drifts over minutes drifts under all of them alike; "
                        "every case's worker and checkpoints exist at once (memory: ~3x --size per case)")
    g.add_argument("--timeout", type=float, default=None, help="seconds per case (default: from the size)")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep", action="store_true", help="also sweep tensor counts and process counts")
    g.add_argument("--sweep-counts", type=_ints, default=[32, 1000, 10000, 100000])
    g.add_argument("--sweep-procs", type=_ints, default=[1, 2, 4])
    g.add_argument("--sweep-rounds", type=int, default=None, help="rounds in the sweep (default: --rounds)")
    g.add_argument("--scale", type=_csv, default=None, metavar="HOSTSxSHARDS[,...]",
                   help="instead of the IO cases: simulate the commit and a host's restore planning of a "
                        "job this large (e.g. 4096x256), see bench/scale.py")
    g.add_argument("--tiers", type=int, nargs="?", const=2, default=None, metavar="HOSTS",
                   help="time to recover from each tier (local SSD, partner's replica, durable fake GCS) and a "
                        "whole restart, with HOSTS processes (2-4, default 2) of --tiers-mib each, see bench/tiers.py")
    g.add_argument("--tiers-scale", type=_csv, default=None, metavar="HOSTS[,...]",
                   help="simulate the tiers' fast-tier save coordination and the restart plan after a host loss "
                        "at these host counts (e.g. 64,512,4096), with the tiers' own code, see bench/tiers_scale.py")
    g.add_argument("--tiers-scale-shards", type=int, default=16, metavar="N",
                   help="shards per host for --tiers-scale (default 16)")
    g.add_argument("--tiers-scale-no-save", dest="tiers_scale_save", action="store_false",
                   help="--tiers-scale: simulate the restart plan only (the save part builds every host's record)")
    g.add_argument("--incremental", type=float, default=None, metavar="FRACTION",
                   help="incremental saves (FRACTION of the arrays changed per step) against full saves")
    g.add_argument("--incremental-steps", type=int, default=10, help="steps for --incremental (default 10)")
    g.add_argument("--reshard", action="store_true",
                   help="restore one row/column block of a --size array saved as 16 row or column blocks: bytes "
                        "read per byte needed, time and peak RSS, tiled and plain layouts (bench/reshard.py)")
    g.add_argument("--tiers-mib", type=int, default=256, help="MiB per host for --tiers (default 256)")
    g.add_argument("--accel", action="store_true",
                   help="a state on the default JAX device: ckptio, under Orbax, stock Orbax (stall, commit, step, restore)")
    g.add_argument("--accel-cases", type=_csv, default=None, metavar="CASE[,...]",
                   help="--accel's cases (default: ckptio, ckptio-host, ckptio-orbax, orbax)")
    g.add_argument("--accel-headroom", type=float, default=None, metavar="F",
                   help="--accel: first fill the device until only F x the state's size is free")
    add_rate_limit_options(p)
    g = p.add_argument_group("advice")
    g.add_argument("--advise", action="store_true", help="Young/Daly checkpoint interval and goodput loss")
    g.add_argument("--mtbf", default="4h", help="mean time between failures for --advise (default 4h)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every raw sample and the environment as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="bar chart with min–max error bars")
    g.add_argument("--from-json", metavar="FILE", help="report (tables, --plot, --advise) from an earlier --json")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--strict", action="store_true", help="exit 1 if any case failed")
    g.add_argument("--check", action="store_true", help="exit 1 if any goal this run could judge was missed "
                                                       "(or any case failed)")
    return p


class _Progress:
    """A tqdm bar over rounds (stderr); silent when tqdm is missing or disabled."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.reserved = 0  # rounds already counted in the total by reserve()
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=0, unit="round", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def reserve(self, n: int) -> None:
        """Count ``n`` planned rounds in the total up front, so the bar does not restart per job."""
        self.reserved += n
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def add(self, n: int) -> None:
        """A job of ``n`` rounds starts: use the reservation, grow the total past it (sweeps)."""
        used = min(n, self.reserved)
        self.reserved -= used
        if self.bar is not None and n > used:
            self.bar.total += n - used
            self.bar.refresh()

    def event(self, label: str, ev: dict[str, Any]) -> None:
        if self.bar is None:
            return
        if ev.get("event") == "round_done":
            self.bar.update(1)
        elif ev.get("event") == "phase":
            self.bar.set_description_str(f"{label} r{ev['round']} {ev['phase']}", refresh=True)

    def finish_job(self, planned: int, done: int) -> None:
        if self.bar is not None and done < planned:
            self.bar.update(planned - done)  # a failed job's remaining rounds

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Runner:
    """Runs one case as a job on the target, with progress, and returns its summarised result."""

    def __init__(self, target: Target, cache_drop: str, rounds: int, verify: bool,
                 timeout: float | None, progress: _Progress, train: bool = False, warmup: int = 0,
                 **flags: Any) -> None:
        self.target, self.cache_drop, self.rounds, self.warmup = target, cache_drop, rounds, warmup
        self.verify, self.timeout, self.progress, self.train = verify, timeout, progress, train
        self.flags = flags  # the Job's other settings: pin, equalize, train_window_s

    def _job(self, cls: type[Case], spec: StateSpec, world_size: int, rounds: int,
             gated: bool = False) -> tuple[Job, float, Callable[[dict[str, Any]], None], Callable[[], int]]:
        """The case's job, its timeout, its event handler (progress) and a count of its rounds done."""
        gib = spec.total_bytes / (1 << 30)
        timeout = self.timeout or (300 + 120 * gib * (rounds + self.warmup)) * (1 + spec.count / 20_000)
        job = Job(case=cls.name, root=self.target.case_root(cls.name), state=spec, rounds=rounds,
                  warmup=self.warmup, cache_drop=self.cache_drop, verify=self.verify, world_size=world_size,
                  train=self.train, gated=gated, **self.flags)
        label = cls.name + (f" ×{world_size}p" if world_size > 1 else "") + (
            f" n={spec.count}" if spec.count != 32 else "")
        self.progress.add(job.total_rounds)
        done = 0

        def on_event(ev: dict[str, Any]) -> None:
            nonlocal done
            done += ev.get("event") == "round_done"
            self.progress.event(label, ev)

        return job, timeout, on_event, lambda: done

    def _finish(self, cls: type[Case], result: dict[str, Any], rounds: int, done: int) -> dict[str, Any]:
        self.progress.finish_job(rounds + self.warmup, done)
        result.update(case=cls.name, kind=cls.kind, framework=cls.framework, description=cls.description,
                      durability=cls.durability)
        report.summarize(result)
        return result

    def __call__(self, cls: type[Case], spec: StateSpec, world_size: int = 1, rounds: int | None = None) -> dict[str, Any]:
        rounds = rounds or self.rounds
        job, timeout, on_event, done = self._job(cls, spec, world_size, rounds)
        try:
            result = run_job(job, self.target, timeout, on_event)
        finally:
            self.target.cleanup_case(job.root)
        return self._finish(cls, result, rounds, done())

    def interleaved(self, classes: Sequence[type[Case]], spec: StateSpec) -> list[dict[str, Any]]:
        """Every case at once, one round at a time in turn (``--interleave``, see run_interleaved)."""
        made = [self._job(cls, spec, 1, self.rounds, gated=True) for cls in classes]
        try:
            results = run_interleaved([m[0] for m in made], self.target, [m[1] for m in made], [m[2] for m in made])
        finally:
            for m in made:
                self.target.cleanup_case(m[0].root)
        return [self._finish(cls, res, self.rounds, m[3]()) for cls, res, m in zip(classes, results, made)]


def _list_cases(scheme: str) -> int:
    rows = []
    for cls in all_cases():
        why = cls.unavailable() or ("" if "*" in cls.schemes or scheme in cls.schemes else f"not on {scheme}://")
        rows.append([cls.name, cls.kind, cls.framework, "yes" if not why else f"no: {why}",
                     ("quick" if cls.name in QUICK_CASES else "--full") if cls.in_default_run else "opt-in",
                     cls.description])
    report.print_table("bench cases", ["case", "kind", "state", "runs here", "default", "what"], rows)
    return 0


def _header(doc: dict[str, Any]) -> str:
    c = doc["config"]
    st = c["state"]
    return (f"ckptio bench — {format_bytes(st['total_bytes'])} as {st['count']} × {st['dtype']}, "
            f"{c['rounds']} rounds{_warmup_note(c.get('warmup', 0))}{' interleaved' if c.get('interleave') else ''}, target {c['target'].get('dir') or c['target'].get('scheme')}, "
            f"cold reads: {doc['cache_drop']['method']}, memory {c.get('memory_state', 'as-is')}"
            + (f", step thread pinned to core {c['pin']['train']}" if c.get("pin") else "")
            + _switch_note(doc.get("env", {}).get("gil_switch_s", "")))


def _switch_note(seconds: float | str | None) -> str:
    """How the JSON's env says saves ran: under a shorter switch interval (ckptio.engine.gilswitch) or not."""
    if seconds == "":  # a run recorded before the setting existed
        return ""
    return f", saves' switch interval {seconds * 1e3:g} ms" if isinstance(seconds, float) else ", switch interval untouched"


def _warmup_note(n: int) -> str:
    return f" after {n} warm-up round{'s' if n != 1 else ''}" if n else ""


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _open_target(args: argparse.Namespace) -> Target:
    """The storage to benchmark: a real ``gs://`` URL means that bucket, the emulator only on ``--fake-gcs``."""
    backend = args.backend
    if args.fake_gcs:
        backend = backend or "gs://bench/ckptio-bench"
        if not backend.startswith("gs://"):
            raise ValueError(f"--fake-gcs benchmarks GCS: --backend must be gs://BUCKET/PREFIX, not {backend!r}")
        with _without_env("CKPTIO_BENCH_GCS_ENDPOINT", "STORAGE_EMULATOR_HOST"):  # no endpoint: start the fake
            return GCSTarget(backend, keep=args.keep)
    if backend is not None and backend.startswith("gs://"):
        from ckptio.backends._gcs_config import GCS_ENDPOINT

        endpoint = (os.environ.get("CKPTIO_BENCH_GCS_ENDPOINT") or os.environ.get("STORAGE_EMULATOR_HOST")
                    or GCS_ENDPOINT)
        return GCSTarget(backend, keep=args.keep, endpoint=endpoint)
    return open_target(backend or args.dir, keep=args.keep)


def _unknown_cases(globs: Sequence[str] | None) -> list[str]:
    """The ``--cases`` / ``--skip`` globs that name no case at all (a typo, not a case that cannot run here)."""
    names = [cls.name for cls in all_cases()]
    return [g for g in globs or () if not any(fnmatch.fnmatchcase(n, g) for n in names)]


def _warn_if_interleaving_will_not_fit(classes: Sequence[type[Case]], spec: StateSpec) -> None:
    """--interleave keeps every case's state in memory at once: say so when that looks too big."""
    import psutil

    # Per case: its state, its staging or restored copy and some slack (~3x).
    need = 3 * spec.total_bytes * len(classes)
    avail = psutil.virtual_memory().available
    if need > avail:
        print(f"warning: --interleave keeps {len(classes)} cases in memory at once (~{format_bytes(need)}), "
              f"{format_bytes(avail)} available: pick fewer --cases", file=sys.stderr)


def _measure(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    spec = StateSpec(total_bytes=parse_size(args.size or "1GiB"), count=args.arrays or 32, dtype=args.dtype)
    if args.pin and not args.train:
        raise ValueError("--pin pins the training thread of --train: add --train")
    if args.train_window is not None and not (args.train and args.train_window > 0):
        raise ValueError(f"--train-window takes seconds > 0 and needs --train (got {args.train_window})")
    if args.warmup < 0 or args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1 and --warmup at least 0 (got {args.rounds}, {args.warmup})")
    pin = pinning.plan() if args.pin else None  # ValueError on one core
    if args.gil_switch is not None:  # the workers inherit it; the JSON's env records it
        os.environ[gilswitch.ENV] = repr(args.gil_switch)
    gilswitch.interval_for(None)  # a bad flag or CKPTIO_GIL_SWITCH_S: one error naming it, before any case runs
    target = _open_target(args)
    progress = _Progress(args.progress)
    try:
        method, reason = target.cache_drop()
        if args.cache_drop != "auto":
            method, reason = args.cache_drop, "forced by --cache-drop"
        sel = select_cases(args.cases, args.skip, target.scheme)
        base = getattr(target, "base", None)
        if base is not None:
            # A case keeps all its rounds' steps + 1; interleaved, every case's steps exist at once.
            need = spec.total_bytes * (args.warmup + args.rounds + 1) * (len(sel.run) if args.interleave else 1)
            free = shutil.disk_usage(base).free
            if free < need:
                who = "the interleaved cases need" if args.interleave else "a case needs"
                print(f"warning: {format_bytes(free)} free under {base}, {who} ~{format_bytes(need)}",
                      file=sys.stderr)
        doc: dict[str, Any] = {
            "schema": SCHEMA, "argv": list(argv),
            "config": {"state": spec.to_json(), "rounds": args.rounds, "warmup": args.warmup, "verify": args.verify,
                       "train": args.train, "train_window_s": args.train_window,
                       "memory_state": "equalized" if args.equalize else "as-is",
                       "pin": pin.to_json() if pin else None,
                       "interleave": args.interleave, "target": target.describe(), "cases": [c.name for c in sel.run]},
            "env": environment(base),
            "cache_drop": {"method": method, "reason": reason},
        }
        run = _Runner(target, method, args.rounds, args.verify, args.timeout, progress, args.train,
                      warmup=args.warmup, pin=bool(pin), equalize=args.equalize,
                      train_window_s=args.train_window)
        progress.reserve(len(sel.run) * (args.warmup + args.rounds))
        if args.interleave:
            _warn_if_interleaving_will_not_fit(sel.run, spec)
            doc["cases"] = run.interleaved(sel.run, spec)
        else:
            doc["cases"] = [run(cls, spec) for cls in sel.run]
        doc["cases"] += [{"case": n, "status": "skipped", "reason": why} for n, why in sel.skipped.items()]
        if args.sweep:
            from ckptio.bench.sweep import plan_sweep, run_sweep

            rounds = args.sweep_rounds or args.rounds
            progress.reserve(len(plan_sweep(sel.run, args.sweep_counts, args.sweep_procs)) * (args.warmup + rounds))
            doc["sweep"] = run_sweep(sel.run, spec, args.sweep_counts, args.sweep_procs,
                                     lambda cls, sp, n: run(cls, sp, n, rounds))
    finally:
        progress.close()
        target.close()
    methods = {s.get("rss_method") for r in doc["cases"] for s in r.get("samples", [])} - {None}
    doc["rss_method"] = sorted(methods)
    return doc


def _scale(args: argparse.Namespace) -> int:
    from ckptio.bench.scale import parse_scale, render, run_scale

    try:
        sizes = [parse_scale(x) for x in args.scale]
    except ValueError as e:
        return _error(str(e))
    _each(args, "scale", [lambda h=h, s=s: run_scale(h, s, args.dir) for h, s in sizes], render)
    return 0


def _each(args: argparse.Namespace, key: str, runs: Sequence[Callable[[], dict[str, Any]]],
          render: Callable[[dict[str, Any]], str]) -> None:
    """Run each simulation, print it as it ends, and write them all to ``--json`` under ``key``."""
    results = []
    for run in runs:
        res = run()
        print(render(res), flush=True)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, key: results}, f, indent=1)


def _tiers(args: argparse.Namespace) -> int:
    from ckptio.bench.tiers import render_tiers, run_tiers

    try:
        res = run_tiers(args.tiers, args.tiers_mib, args.rounds, args.dir)
    except (ValueError, RuntimeError) as e:
        return _error(str(e))
    print(render_tiers(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "tiers": res}, f, indent=1)
    return 0


def _tiers_scale(args: argparse.Namespace) -> int:
    from ckptio.bench.tiers_scale import parse_tiers_scale, render_tiers_scale, run_tiers_scale

    try:
        hosts = parse_tiers_scale(args.tiers_scale)
    except ValueError as e:
        return _error(str(e))
    _each(args, "tiers_scale", [lambda h=h: run_tiers_scale(h, args.tiers_scale_shards, args.dir,
                                                            save=args.tiers_scale_save) for h in hosts],
          render_tiers_scale)
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from ckptio.bench.reshard import render_reshard, run_reshard

    res = run_reshard(parse_size(args.size or "1GiB"), args.dir, args.cache_drop, args.rounds)
    print(render_reshard(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "reshard": res}, f, indent=1)
    return 0 if all(r["bit_exact"] for r in res["rows"]) else 1


def _accel(args: argparse.Namespace) -> int:
    from ckptio.bench.accel import CASES, render_accel, run_accel

    cases = args.accel_cases or list(CASES)
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        return _error(f"no --accel case is called {', '.join(map(repr, unknown))} (they are {', '.join(CASES)})")
    res = run_accel(parse_size(args.size or "1GiB"), args.rounds, args.dir, cases, args.arrays or 24,
                    args.accel_headroom)
    print(render_accel(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "accel": res}, f, indent=1)
    bad = [n for n, c in res["cases"].items() if "error" in c or not c.get("bit_exact", True)]
    return 1 if bad and args.strict else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.accel:
        return _accel(args)
    if args.scale:
        return _scale(args)
    if args.tiers is not None:
        return _tiers(args)
    if args.tiers_scale:
        return _tiers_scale(args)
    if args.reshard:
        return _reshard(args)
    if args.incremental is not None:
        from ckptio.bench.incremental import main_incremental

        return main_incremental(args.incremental, parse_size(args.size or "1GiB"), args.arrays or 100,
                                args.incremental_steps, args.dir, args.keep)
    if args.rate_limit is not None:
        return main_rate_limit_args(args, _error)
    if args.list:
        backend = args.backend or ("gs://" if args.fake_gcs else "")
        return _list_cases(backend.split("://", 1)[0] if "://" in backend else "file")
    if args.full and args.cases is not None:
        return _error("--full runs every default case: it cannot be combined with --cases")
    quick = args.cases is None and not args.full and not args.from_json
    if quick:
        args.cases, args.size = list(QUICK_CASES), args.size or QUICK_SIZE
    unknown = _unknown_cases(args.cases) + _unknown_cases(args.skip)
    if unknown and not args.from_json:
        return _error(f"no case is called {', '.join(map(repr, unknown))} "
                      "(`ckptio bench --list` shows the cases)")
    if args.interleave and args.fake_gcs:
        return _error("--interleave cannot be combined with --fake-gcs: each case gets a fresh fake server, "
                      "and only one can run at a time")
    try:
        mtbf_s = parse_duration(args.mtbf)
    except ValueError as e:
        return _error(str(e))
    if args.from_json:
        with open(args.from_json) as f:
            doc = json.load(f)
    else:
        try:
            doc = _measure(args, argv)
        except (NotImplementedError, ValueError) as e:
            return _error(str(e))
    results = [r for r in doc["cases"] if r.get("status") != "skipped"]
    skipped = {r["case"]: r.get("reason", "") for r in doc["cases"] if r.get("status") == "skipped"}
    doc["ratios"] = report.compute_ratios(results)
    doc["goals"] = report.check_goals(results)
    report.render_main(results, skipped, _header(doc))
    if not quick:  # the quick default prints the goals alone; chosen --cases and --full every ratio
        report.render_ratios(results, doc["ratios"])
    report.render_goals(doc["goals"])
    if quick:
        print(quick_note())
    missed = report.verdict_line(doc["goals"], check=args.check)
    if doc.get("sweep"):
        from ckptio.bench.sweep import render_sweep

        render_sweep(doc["sweep"])
    if args.advise:
        doc["advise"] = advise(results, mtbf_s)
        render_advice(doc["advise"], mtbf_s)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        from ckptio.bench.plot import plot

        plot(args.plot, results, _header(doc))
    failed = [r["case"] for r in results if r.get("status") != "ok"]
    if failed:
        print(f"failed cases: {', '.join(failed)} (see the table / --json for why)", file=sys.stderr)
    return 1 if (failed and (args.strict or args.check)) or (missed and args.check) else 0
