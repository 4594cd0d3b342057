"""The ``ckptio`` command: ls, inspect, verify, gc, cp, convert, bench.

Errors are one line on stderr, ``ckptio: error: <what, naming the URL, step
or object>``, and a distinct exit status (see :data:`EXIT_CODES`); with
``--json`` the error is a JSON object on stdout instead; ``--debug`` shows the
traceback. The commands live beside this module (``reading``: ls, inspect,
verify; ``writing``: cp, convert, gc; ``where``: what a URL names).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from ckptio.cli.errors import EXIT_CODES, CliError, kind_of, report
from ckptio.cli.reading import inspect, ls, verify
from ckptio.cli.writing import convert, cp, gc
from ckptio.store import check_grace

__all__ = ["EXIT_CODES", "CliError", "main"]


def _bench(argv: list[str]) -> int:
    from ckptio.bench import main as bench_main

    return bench_main(argv)


def _grace(text: str) -> float:
    """``--grace``: refused as a usage error (one line, exit 2) unless a finite number >= 0."""
    try:
        return check_grace(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse that raises a usage CliError instead of printing and exiting (main reports it)."""

    def error(self, message: str) -> NoReturn:
        raise CliError("usage", f"{message} (see `{self.prog} --help`)")


_EPILOG = """\
URLs: a path or file://PATH (local disk), gs://BUCKET/PREFIX (GCS), mem://NAME, hdml://PATH,
pstore://PATH, fsspec+PROTOCOL://... (any fsspec filesystem, e.g. fsspec+s3://bucket/run).

exit status: 0 ok, 1 failed, 2 usage (bad arguments or URL), 3 not found, 4 damaged
(a manifest or object fails its checks), 5 storage unreachable, 6 permission denied.
Errors are one line, "ckptio: error: ..."; --json prints them as JSON; --debug shows the traceback.
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptio`` argument parser (``bench`` has its own: ``ckptio bench --help``)."""
    from ckptio import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the traceback")
    p = _Parser(prog="ckptio", parents=[common], epilog=_EPILOG,
                description="Inspect, verify, copy, convert and clean up ckptio checkpoints; benchmark storage.",
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ckptio {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("bench", help="IO benchmark against the raw disk, Orbax and DCP (see `ckptio bench --help`)",
                   add_help=False)
    step_dir_note = " {} may also be a step directory (ROOT/N): read as ROOT --step N."
    for name, fn, hlp in (("ls", ls, "list the steps under URL: state, size, time"),
                          ("inspect", inspect, "items, shapes, shards of one step"),
                          ("verify", verify, "re-read everything and check every checksum")):
        description = hlp[0].upper() + hlp[1:] + "." + step_dir_note.format("URL")
        sp = sub.add_parser(name, help=hlp, description=description, parents=[common])
        sp.add_argument("url", metavar="URL")
        if name == "ls":
            sp.add_argument("--step", type=int, default=None,
                            help="list this step only (default: every step)")
        else:
            sp.add_argument("--step", type=int, default=None, help="the step (default: the newest intact one)")
        sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
        sp.set_defaults(fn=fn)
    hlp = "delete what crashed saves left (orphan objects, temporaries, dead intents)"
    sp = sub.add_parser("gc", help=hlp, parents=[common], description=(
        f"{hlp[0].upper()}{hlp[1:]} under the root URL. Deletes only keys ckptio writes, never an object a "
        "committed checkpoint names or a live save announced; a damaged step's objects are kept. "
        "Orbax step directories are left to Orbax."))
    sp.add_argument("url", metavar="URL")
    sp.add_argument("--grace", type=_grace, default=3600.0,
                    help="only objects older than this many seconds (default: %(default)g)")
    sp.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    sp.add_argument("--json", action="store_true", help="the report as one JSON object")
    sp.set_defaults(fn=gc)
    hlp = "copy a checkpoint between backends (verified, committed last)"
    sp = sub.add_parser("cp", help=hlp, parents=[common], description=(
        "Copy one committed checkpoint from SRC to DST (any two backends): every object is verified "
        "against its checksums on the way, the manifest is committed at DST last, and a copy that was "
        "interrupted resumes." + step_dir_note.format("SRC")))
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--step", type=int, default=None, help="step to copy (default: the newest committed)")
    sp.add_argument("--dst-step", type=int, default=None, help="step at the destination (default: the same)")
    sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
    sp.set_defaults(fn=cp)
    from ckptio.convert import FORMATS

    hlp = "DCP / Orbax checkpoint directory <-> ckptio, streaming"
    sp = sub.add_parser("convert", help=hlp, parents=[common], description=(
        "Convert a PyTorch DCP or Orbax PyTree checkpoint directory into a ckptio checkpoint, or a ckptio "
        "checkpoint out to one, streaming. One side must be ckptio." + step_dir_note.format("A ckptio SRC")))
    sp.add_argument("src", metavar="SRC")
    sp.add_argument("dst", metavar="DST")
    sp.add_argument("--from", dest="src_format", choices=FORMATS, required=True, help="the format of SRC")
    sp.add_argument("--to", dest="dst_format", choices=FORMATS, required=True,
                    help="the format to write DST in")
    sp.add_argument("--step", type=int, default=None,
                    help="the ckptio side's step: to read (default: the newest) or to write "
                         "(default: DST itself)")
    sp.add_argument("--json", action="store_true", help="the answer (or the error) as JSON on stdout")
    sp.set_defaults(fn=convert)
    return p


def _log_to_stderr(debug: bool) -> None:
    """ckptio's warnings (a damaged step skipped, a read retried) as ``ckptio: warning: ...`` lines."""
    log = logging.getLogger("ckptio")
    if any(getattr(h, "_ckptio_cli", False) for h in log.handlers) or logging.getLogger().handlers:
        return  # the host program (or an earlier call) configured logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("ckptio: %(levelname)s: %(message)s" if not debug else
                                           "%(asctime)s %(name)s %(levelname)s: %(message)s"))
    handler._ckptio_cli = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if debug else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """Run the ``ckptio`` command; returns its exit status (see :data:`EXIT_CODES`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    debug = "--debug" in argv
    as_json = "--json" in argv
    _log_to_stderr(debug)
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        return report(e, "usage", None, as_json)
    url = getattr(args, "url", None) or getattr(args, "src", None)
    try:
        return int(args.fn(args))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- a library's BaseException (torch DCP's) is still one line
        if debug:
            raise
        return report(e, kind_of(e), url, as_json)

