"""Every code block of README.md and docs/*.md runs as written, or is checked for what it claims.

A fenced block's kind comes from its language and an optional marker on the line just above it,
``<!-- snippet: KIND[: reason] -->``:

- ``python``: run in a fresh interpreter, cwd an empty temporary directory, 8 host devices for JAX.
  Marker ``continues``: appended to the file's previous python block, the two run as one program.
- ``bash``: run with ``bash -euo pipefail`` there, the venv's ``ckptio`` and ``python`` first on PATH.
- ``toml``: parsed.
- marker ``install``, or a bash block whose every line runs ``pip install``: set-up lines, not run (they
  install): every extra they name must be in pyproject.toml and every ``-c FILE`` must exist.
- marker ``cli-synopsis``: ``ckptio COMMAND [options]`` lines: the command and each ``--option`` must be
  ckptio's.
- marker ``skip: REASON``: not run; the reason is said in the markdown, and this test reports it.

Any other block fails the inventory: nothing is skipped silently.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*snippet:\s*([a-z-]+)\s*(?::\s*(.*?))?\s*-->\s*$")
RUNS = {"python", "bash", "toml", "install", "cli-synopsis"}
BLOCK_TIMEOUT_S = 600  # a loaded 2-core CI box; the blocks take seconds when it is quiet


@dataclass
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None
    reason: str | None
    code: str
    joined: str = ""  # the lines of ``continues`` blocks run with this one

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def kind(self) -> str:
        if self.marker in ("install", "cli-synopsis", "skip"):
            return self.marker
        lines = [ln for ln in self.code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        if self.lang == "bash" and lines and all("pip install" in ln for ln in lines):
            return "install"
        return self.lang


def _blocks(path: Path) -> list[Block]:
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mk = MARKER.match(lines[j]) if j >= 0 else None
        end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
        out.append(Block(str(path.relative_to(REPO)), i + 1, m.group(1), mk and mk.group(1),
                         mk and mk.group(2), "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return out


def _programs() -> list[Block]:
    """The blocks to check, a ``continues`` block merged into the python block before it."""
    out: list[Block] = []
    for path in DOCS:
        for b in _blocks(path):
            if b.marker == "continues":
                prev = next(p for p in reversed(out) if p.file == b.file and p.lang == "python")
                prev.code += "\n" + b.code
                prev.joined += f" + line {b.line}"
                continue
            out.append(b)
    return out


BLOCKS = _programs()


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp)  # the blocks' tempfile.mkdtemp() directories go with the test's tmp_path
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(argv: list[str], cwd: Path) -> None:
    p = subprocess.run(argv, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-6000:]}"


def test_inventory() -> None:
    """Every block is of a kind this test runs or checks; a skipped one says why; the list is printed."""
    bad = [b.id for b in BLOCKS if b.kind not in RUNS | {"skip"} or (b.kind == "skip" and not b.reason)]
    assert not bad, f"blocks neither runnable nor marked `<!-- snippet: skip: why -->`: {bad}"
    counts: dict[str, int] = {}
    for b in BLOCKS:
        counts[b.kind] = counts.get(b.kind, 0) + 1
    report = [f"{b.id:24} {b.kind:13} {b.reason or b.joined.strip()}" for b in BLOCKS]
    print("\n".join(["", "code blocks of README.md and docs/*.md:", *report, f"totals: {counts}"]))
    assert counts.get("python", 0) >= 3  # the three quickstarts at least


def _of(kind: str) -> list[pytest.param]:
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.kind == kind]


@pytest.mark.slow  # each block is a fresh program importing torch/jax; the inventory and checks stay in the quick tier
@pytest.mark.parametrize("block", _of("python"))
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    (tmp_path / "snippet.py").write_text(block.code)
    _run([sys.executable, "snippet.py"], tmp_path)


@pytest.mark.slow  # each block is a fresh program importing torch/jax; the inventory and checks stay in the quick tier
@pytest.mark.parametrize("block", _of("bash"))
def test_bash_block_runs(block: Block, tmp_path: Path) -> None:
    argv = ["bash", "-euo", "pipefail", "-c", block.code]
    if "torch.distributed.run" not in block.code:
        _run(argv, tmp_path)
        return
    # The torchrun example failed 2 times in ~10 runs of this file beside other tests (never in 10
    # runs alone); the cause is not found yet. One more try in a fresh directory, the first
    # failure shown as a warning so that it stays visible.
    first = subprocess.run(argv, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                           timeout=BLOCK_TIMEOUT_S)
    if first.returncode != 0:
        warnings.warn(f"{block.id}: torchrun example failed once (exit {first.returncode}), retried:\n"
                      f"{first.stderr[-3000:]}", stacklevel=1)
        fresh = tmp_path / "retry"
        fresh.mkdir()
        _run(argv, fresh)


@pytest.mark.parametrize("block", _of("toml"))
def test_toml_block_parses(block: Block) -> None:
    assert tomllib.loads(block.code)


@pytest.mark.parametrize("block", _of("install"))
def test_install_block_names_real_extras(block: Block) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    for line in block.code.splitlines():
        if "pip install" not in line:
            continue
        words = shlex.split(line.split("#", 1)[0])
        for c in (words[i + 1] for i, w in enumerate(words) if w == "-c"):
            assert (REPO / c).is_file(), f"{block.id}: {c} does not exist"
        named = [w for w in words if re.fullmatch(r"(ckptio|\.)\[[a-z,]+\]", w)]
        assert named, f"{block.id}: a pip line that installs no ckptio extra: {line}"
        for w in named:
            for extra in w[w.index("[") + 1 : -1].split(","):
                assert extra in extras, f"{block.id}: no extra {extra!r} in pyproject.toml"


def _cli_options() -> dict[str, set[str]]:
    import argparse

    from ckptio.bench.cli import build_parser as bench_parser
    from ckptio.cli import build_parser

    def options(p: argparse.ArgumentParser) -> set[str]:
        return {s for a in p._actions for s in a.option_strings}

    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: options(p) for name, p in sub.choices.items()}
    out["bench"] = options(bench_parser())
    out[""] = options(root)
    return out


@pytest.mark.parametrize("block", _of("cli-synopsis"))
def test_cli_synopsis_matches_the_parser(block: Block) -> None:
    known = _cli_options()
    for line in block.code.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        assert words[0] == "ckptio", f"{block.id}: not a ckptio command line: {line}"
        cmd = words[1] if len(words) > 1 and not words[1].startswith("-") else ""
        assert cmd in known, f"{block.id}: no command {cmd!r}"
        for opt in re.findall(r"--[a-z][a-z-]*", line.split("#", 1)[0]):
            assert opt in known[cmd], f"{block.id}: `ckptio {cmd}` has no option {opt}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists (and a heading there)."""
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}: {target}")
            elif anchor and dest.suffix == ".md":
                heads = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
                if anchor not in {_slug(h) for h in heads}:
                    broken.append(f"{path.name}: {target} (no such heading)")
    assert not broken, broken


def test_ci_runs_the_readmes_test_command() -> None:
    """``.ci/run`` runs exactly the README's test line (CI runs what a newcomer runs): the quick tier
    (``-m "not slow"``), then the slow tier (``-m slow``), so the two together leave no test out;
    xdist (``-n``) is in the test extra for those who spread a tier over their cores."""
    line = next(ln for ln in (REPO / "README.md").read_text().splitlines() if "python -m pytest" in ln)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert line.strip() in ci, f".ci/run does not run the README's test line: {line}"
    quick = shlex.split(line.split("&&")[-1])
    assert quick == ["python", "-m", "pytest", "-q", "-m", "not slow"], quick
    after = ci[ci.index(line.strip()) + 1 :]
    slow = [shlex.split(ln) for ln in after if ln.strip().startswith("python -m pytest")]
    assert slow == [["python", "-m", "pytest", "-q", "-m", "slow"]], slow
    test_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(re.match(r"pytest-xdist\b", d) for d in test_extra), test_extra
