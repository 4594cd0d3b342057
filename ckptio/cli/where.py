"""What a command's URL names: a store opened and closed, a step directory read as its root, refusals.

A step directory (``ck/30``) is the natural first guess for a URL; read as a root of its own it
would look damaged, so :func:`at_step` reads it as its root and ``--step``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

from ckptio.cli.errors import CliError
from ckptio.engine import run_sync
from ckptio.errors import IntegrityError, ManifestError
from ckptio.manifest import MANIFEST_NAME, TOMBSTONE_NAME, Manifest
from ckptio.manifest.names import parse_fence, parse_intent, parse_object
from ckptio.store import MAX_STEP, CheckpointStore, check_binding
from ckptio.store.orbax_steps import COMMIT_SUCCESS_NAME, STEP_METADATA_NAME
from ckptio.store.urls import file_in_the_way, local_path

__all__ = ["at_step", "nothing_there", "open_store", "refuse_a_file", "refuse_memory", "resolve"]

_FSSPEC_PROTOCOLS = ("s3", "s3a", "az", "abfs", "abfss", "adl", "hf", "http", "https", "oss", "r2", "sftp", "webdav")


@contextlib.contextmanager
def open_store(url: str) -> Iterator[CheckpointStore]:
    """Open ``url``'s store and always close it (an unclosed GCS session warns at exit)."""
    try:
        store = CheckpointStore(url)
    except ValueError as e:
        raise CliError("usage", _scheme_hint(url, str(e))) from e
    try:
        yield store
    finally:
        try:
            run_sync(store.close())
        except Exception:  # the command's own error is the one worth reporting
            pass


def _scheme_hint(url: str, message: str) -> str:
    """An unknown scheme's error, with the fsspec spelling when fsspec has that protocol."""
    if "://" not in url or "no ckptio backend" not in message:
        return message
    scheme = url.split("://", 1)[0].lower()
    known = scheme in _FSSPEC_PROTOCOLS
    try:
        import fsspec

        known = known or scheme in fsspec.available_protocols()
    except ImportError:
        pass
    if not known:
        return message
    return f"{message}. For {scheme}:// through fsspec use fsspec+{url} (pip install 'ckptio[fsspec]' and its package)"


def nothing_there(url: str) -> str:
    """Why ``ls`` found no checkpoint under ``url``, as precisely as the storage allows."""
    path = local_path(url)
    if path is not None:
        if not os.path.lexists(path):
            return f"{url} does not exist"
        if not os.path.isdir(path):
            return f"{url} is a file, not a checkpoint directory"
        return f"{url} holds no ckptio checkpoint (no step directory with a {MANIFEST_NAME}, none at the top)"
    return f"no ckptio checkpoint under {url}"


def _step_dir_url(url: str) -> tuple[str, int] | None:
    """``(root, step)`` when ``url`` names a step directory of a ckptio root (``ck/30``), else None.

    Pointing at a step directory is the natural first guess, and read as a root of its own it
    looks damaged (its manifest's objects lie in step 30 of the root above). It is one if its
    name is a step number and its manifest records that step with every object in it, or, with
    no manifest (a save in flight or crashed, an Orbax step), it holds what ckptio or Orbax
    writes into a step directory. A checkpoint saved at a directory named like a step (its
    manifest records no step) stays a root.
    """
    trimmed = url.rstrip("/")
    prefix, rest = ("", trimmed) if "://" not in trimmed else (trimmed.split("://", 1)[0] + "://",
                                                               trimmed.split("://", 1)[1])
    head, sep, name = rest.rpartition("/")
    if not (name.isdigit() and str(int(name)) == name and int(name) <= MAX_STEP):
        return None
    if not sep:
        if prefix:
            return None  # a bucket (or memory store) named like a number: there is no root above it
        head = "."
    root, step = prefix + (head or "/"), int(name)
    path = local_path(trimmed)
    if path is not None and not os.path.isdir(path):
        return None
    with open_store(trimmed) as store:
        try:
            data: bytes | None = run_sync(store.io.read(MANIFEST_NAME))
        except FileNotFoundError:
            data = None
        except OSError:
            return None  # unreadable: the command run as given says why, naming the URL
        if data is not None:
            try:
                manifest: Manifest | None = Manifest.from_json(data, url)
            except (ManifestError, IntegrityError):
                manifest = None  # damaged: only what else lies here can tell
            if manifest is not None:
                try:
                    check_binding(manifest, name, url)
                except ManifestError:
                    return None  # a checkpoint of its own (saved at this URL), or one copied here
                return root, step
        children = run_sync(store.backend.list_children(""))
    marks = {STEP_METADATA_NAME, COMMIT_SUCCESS_NAME, TOMBSTONE_NAME}
    for c in children:
        parsed = parse_intent(f"{name}/{c}") or parse_fence(f"{name}/{c}") or parse_object(f"{name}/{c}")
        if c in marks or (parsed is not None and parsed.step_dir == name):
            return root, step
    return None


def at_step(args: argparse.Namespace, attr: str = "url") -> None:
    """Read a step directory given as ``args.<attr>`` as its root and ``--step`` (:func:`_step_dir_url`)."""
    url = getattr(args, attr)
    found = _step_dir_url(url)
    if found is None:
        return
    root, step = found
    if args.step is not None and args.step != step:
        raise CliError("usage", f"{url} is step {step} of {root}, but --step {args.step} was given: "
                                "give the root with --step, or the step directory alone", url=url)
    setattr(args, attr, root)
    args.step = step


def refuse_memory(url: str, role: str) -> None:
    """A ``mem://`` destination lives in this process: whatever is written there is gone at exit."""
    if "://" in url and url.split("://", 1)[0].lower() == "mem":
        raise CliError("usage", f"{role} {url} is an in-memory store that vanishes when this command exits: "
                                "give a path or a bucket", url=url)


def refuse_a_file(url: str, role: str) -> None:
    problem = file_in_the_way(url)
    if problem:
        raise CliError("usage", f"{role} {problem}", url=url)


def resolve(store: CheckpointStore, url: str, step: int | None) -> tuple[str, Manifest]:
    """The step directory and manifest of ``step`` (None: the newest intact one) under ``url``."""
    path = local_path(url)
    if path is not None and not os.path.isdir(path):
        raise CliError("not-found", nothing_there(url), url=url)
    step_dir = run_sync(store.resolve(step))
    return step_dir, run_sync(store.read_manifest(step_dir))
