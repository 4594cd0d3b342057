"""``ckptio bench --fake-gcs --rate-limit R``'s options and its entry (:mod:`ckptio.bench.throttled`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["add_rate_limit_options", "main_rate_limit_args"]


def add_rate_limit_options(p: argparse.ArgumentParser) -> None:
    """The rate-limit option group of ``ckptio bench``."""
    g = p.add_argument_group("rate limit")
    g.add_argument("--rate-limit", type=float, default=None, metavar="R",
                   help="with --fake-gcs: --hosts simulated hosts save and restore one checkpoint at once behind "
                        "a proxy that admits R requests/s per class (429 beyond); failures, wrong 'no checkpoint' "
                        "and time against what R allows (bench/throttled.py)")
    g.add_argument("--hosts", type=int, default=64, help="simulated hosts for --rate-limit (default 64)")
    g.add_argument("--budget", default="0.8", metavar="FRACTION|none",
                   help="the job's request budget for --rate-limit, as a fraction of R (default 0.8); none: no budget")
    g.add_argument("--host-processes", action="store_true",
                   help="--rate-limit: each simulated host its own process, forked before the server starts, pacing "
                        "its requests on its own event loop as a real job's host does (default: threads of one "
                        "process, whose requests bunch while it is busy; bench/hostprocs.py)")


def main_rate_limit_args(args: argparse.Namespace, error: Callable[[str], int]) -> int:
    """Run ``--rate-limit`` from the parsed ``args``; ``error(message) -> int`` reports a bad option."""
    from ckptio.bench.throttled import main_rate_limit

    if not args.fake_gcs:
        return error("--rate-limit runs against the local fake GCS: add --fake-gcs")
    if args.hosts < 1:
        return error(f"--hosts must be at least 1, got {args.hosts}")
    budget = args.budget.strip().lower()
    if budget != "none":
        try:
            ok = float(budget) > 0
        except ValueError:
            ok = False
        if not ok:
            return error(f"--budget must be a fraction of R above 0, or none; got {args.budget!r}")
    return main_rate_limit(args.rate_limit, args.hosts, args.budget, processes=args.host_processes,
                           json_path=args.json)
