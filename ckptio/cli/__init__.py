"""The ``ckptio`` command: ls, inspect, verify, gc, cp, convert, bench (:mod:`.command`: the parser and
entry point; :mod:`.reading`, :mod:`.writing`: the commands; :mod:`.where`: what a URL names;
:mod:`.errors`: one line and an exit status per failure)."""

from __future__ import annotations

from ckptio.cli.command import EXIT_CODES, CliError, build_parser, main

__all__ = ["EXIT_CODES", "CliError", "build_parser", "main"]
