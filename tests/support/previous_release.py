"""A previous release of ckptio, checked out with git, run on a root this version wrote.

Compatibility tests (``tests/store/test_pins_guard.py``, ``tests/saving/incremental/test_hosts.py``) have
an older release gc a root, delete steps of it and do what else they ask, importing its own code,
then check with this version that nothing a kept step references was lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

#: What the older release runs (``python -c``; argv: the root, then the steps to delete): its gc
#: (grace 0), its ``delete`` of each step, ``{with_store}`` while its store is open, and
#: ``{after_close}`` once it is closed. ``{version}``: the manifest format that release writes,
#: checked so that a wrong checkout fails loudly instead of testing this tree against itself.
_SCRIPT = """
import sys
from ckptio.engine import run_sync
from ckptio.manifest.formats import VERSION
from ckptio.store import CheckpointStore
assert VERSION == {version}, VERSION
store = CheckpointStore(sys.argv[1])
report = run_sync(store.sweep(0))
print("old gc deleted", report.deleted, "damaged", report.damaged)
for step in sys.argv[2:]:
    try:
        run_sync(store.delete(step))
        print("old delete", step, "done")
    except Exception as e:
        print("old delete", step, "refused:", repr(e))
{with_store}
run_sync(store.close())
{after_close}
"""


def previous_release(tmp_path: Path, commit: str) -> Path:
    """The package of release ``commit`` (``git archive``) under ``tmp_path``, importable as ckptio."""
    if not (REPO / ".git").exists():
        pytest.skip("needs this repository's git history (the previous release's code)")
    out = tmp_path / "previous"
    out.mkdir()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "ckptio", "backends"],
                         capture_output=True)
    if tar.returncode != 0:
        pytest.skip(f"git archive {commit[:7]} failed: {tar.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar.stdout, check=True)
    (out / "backends").rename(out / "ckptio" / "backends")
    return out


def run_previous(
    old: Path, root: Path, steps: list[int], cwd: Path, *, version: int, with_store: str = "",
    after_close: str = "",
) -> subprocess.CompletedProcess[str]:
    """The release at ``old`` (from :func:`previous_release`) runs :data:`_SCRIPT` on ``root``,
    deleting ``steps``; asserts it ran to the end on its own code, not this tree's."""
    script = _SCRIPT.format(version=version, with_store=with_store, after_close=after_close)
    env = {**os.environ, "PYTHONPATH": str(old)}
    done = subprocess.run([sys.executable, "-c", script, str(root), *map(str, steps)], env=env,
                          capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{old}/ckptio" not in done.stderr
    return done
