"""``ckptio bench``: ckptio's IO benchmark, side by side with the raw disk, Orbax, DCP, torch.save and tensorstore.

Entry points: :func:`main` (what ``ckptio bench ...`` and ``python -m ckptio.bench`` call) and
:func:`build_parser`. Cases live in :mod:`ckptio.bench.cases` (interface and registry); each runs in
a fresh worker process (:mod:`ckptio.bench.worker`) driven by :mod:`ckptio.bench.harness`.
Importing this package imports no framework.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "ckptio bench") -> argparse.ArgumentParser:
    """The ``ckptio bench`` argument parser."""
    from ckptio.bench.cli import build_parser as _build_parser

    return _build_parser(prog)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ckptio bench`` with ``argv`` (without the program name); returns the exit code."""
    from ckptio.bench.cli import main as _main

    return _main(argv)
