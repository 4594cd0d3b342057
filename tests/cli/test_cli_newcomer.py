"""Issue #36, the newcomer's path through ``ckptio``: what a first session runs into.

``ls`` on a root written through ``ckptio.orbax`` (Orbax steps, not ckptio steps),
a step directory given where a root is expected (``ckptio inspect ck/30``),
a traceback from ``convert``, help without descriptions, a ``mem://``
destination, a progress bar before a "no such source" error, and ``bench``'s
own error prefix.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptio
from ckptio.backends.memory import MemoryBackend
from ckptio.cli import EXIT_CODES, main
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME
from ckptio.store import CheckpointStore
from ckptio.store.orbax_steps import COMMIT_SUCCESS_NAME, HANDLER, STEP_METADATA_NAME

HAS_ORBAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("orbax") is not None


def run(*argv: str) -> tuple[int, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    out = buf.getvalue()
    return rc, (json.loads(out) if "--json" in argv and out.strip() else out)


def state(i: int) -> dict[str, Any]:
    return {"w": np.arange(64, dtype=np.float32) + i, "step": i}


def save(url: Path | str, step: int | None, i: int = 0) -> None:
    ckptio.save(url, state(i), step=step).result()


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def one_error_line(err: str) -> str:
    """The single line the command printed on stderr (no progress bar, no traceback)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckptio: error: ") and "Traceback" not in err, err
    return lines[0]


# -- 1. Orbax steps in `ckptio ls` --------------------------------------------------------------

# Orbax runs in a child: jax fixes its device count at import, and other test files import it.
ORBAX_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import orbax.checkpoint as ocp
    import ckptio.orbax
    from ckptio.engine.layout import HashedNaming

    mode, work = sys.argv[1], sys.argv[2]
    def state(i):
        return {"w": np.arange(64, dtype=np.float32) + i, "step": i}
    opts = ocp.CheckpointManagerOptions(max_to_keep=2)
    if mode == "save":
        with ocp.CheckpointManager(f"{work}/inplace", options=opts) as m:
            for i in range(3):
                m.save(i, args=ckptio.orbax.Save(state(i)))
        with ckptio.orbax.CheckpointManager(f"{work}/orbax", options=opts, storage=f"{work}/ext",
                                            naming=HashedNaming()) as m:
            for i in (10, 20):
                m.save(i, args=ocp.args.Composite(state=ckptio.orbax.Save(state(i)),
                                                  extra=ocp.args.JsonSave({"i": i})))
    else:
        with ocp.CheckpointManager(f"{work}/inplace", options=opts) as m:
            assert m.all_steps() == [1, 2], m.all_steps()
            got = m.restore(2, args=ckptio.orbax.Restore())
            assert np.array_equal(np.asarray(got["w"]), state(2)["w"]), got
        with ckptio.orbax.CheckpointManager(f"{work}/orbax", options=opts, storage=f"{work}/ext",
                                            naming=HashedNaming()) as m:
            args = ocp.args.Composite(state=ckptio.orbax.Restore(), extra=ocp.args.JsonRestore())
            got = m.restore(20, args=args)
            assert np.array_equal(np.asarray(got["state"]["w"]), state(20)["w"]) and got["extra"] == {"i": 20}
    print("ok")
""")


def orbax_child(mode: str, work: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ORBAX_CHILD, mode, str(work)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def orbax_roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAS_ORBAX:
        pytest.skip("needs jax and orbax-checkpoint")
    work = tmp_path_factory.mktemp("orbax_roots")
    orbax_child("save", work)
    return work


def test_ls_calls_orbax_steps_written_through_the_adapter_committed(orbax_roots: Path) -> None:
    rc, rows = run("ls", str(orbax_roots / "inplace"), "--json")
    assert rc == 0 and [r["step"] for r in rows] == [1, 2]  # max_to_keep=2: Orbax deleted step 0
    for r in rows:
        assert r["state"] == "committed" and r["committed"] and r["bytes"] == 64 * 4 and r["created"], r
        (item,) = r["orbax"]["items"]
        assert r["orbax"]["finalized"] and item["name"] == "default", r
        assert item["handler"] == HANDLER.rpartition(".")[2]
        assert item["ckptio"]["state"] == "committed" and item["ckptio"]["step"] is None  # in the item dir
    rc, rows = run("ls", str(orbax_roots / "orbax"), "--json")
    assert rc == 0 and [r["step"] for r in rows] == [10, 20]
    for r in rows:
        assert r["state"] == "committed", r
        items = {it["name"]: it for it in r["orbax"]["items"]}
        assert items["extra"] == {"name": "extra", "handler": "JsonCheckpointHandler"}
        ext = items["state"]["ckptio"]
        assert ext["url"] == f"{orbax_roots}/ext/state" and ext["step"] == r["step"]
        assert ext["state"] == "committed"
    rc, text = run("ls", str(orbax_roots / "orbax"))
    assert rc == 0 and "UNCOMMITTED" not in text and "swept" not in text
    assert "Orbax step: extra (JsonCheckpointHandler), state (ckptio external" in text


def test_gc_spares_orbax_steps_and_orbax_restores_them_after(orbax_roots: Path) -> None:
    before = files(orbax_roots)
    for root in ("inplace", "orbax", "ext/state"):
        rc, report = run("gc", str(orbax_roots / root), "--grace", "0", "--json")
        assert rc == 0 and report["objects"] == [] and report["intents"] == [], (root, report)
    assert files(orbax_roots) == before
    rc, rows = run("ls", str(orbax_roots / "inplace"), "--json")
    assert [r["state"] for r in rows] == ["committed", "committed"]
    orbax_child("restore", orbax_roots)


def orbax_step_by_hand(root: Path, step: int, *, commit_file: bool = True) -> None:
    """What ``ckptio.orbax.Save`` under an Orbax manager leaves: a ckptio checkpoint in the item directory."""
    save(root / str(step) / "default", None, step)
    meta = {"item_handlers": {"default": HANDLER}, "commit_timestamp_nsecs": 1_700_000_000 * 10**9}
    (root / str(step) / STEP_METADATA_NAME).write_text(json.dumps(meta))
    if commit_file:
        (root / str(step) / COMMIT_SUCCESS_NAME).write_text("Checkpoint commit was successful")


def test_ls_orbax_step_whose_ckptio_item_lost_data_is_damaged_naming_the_item(tmp_path: Path) -> None:
    orbax_step_by_hand(tmp_path, 1)
    orbax_step_by_hand(tmp_path, 2)
    orbax_step_by_hand(tmp_path, 3)
    m = run_sync(CheckpointStore(tmp_path / "2" / "default").read_manifest(""))
    os.remove(tmp_path / "2" / "default" / m.objects[0])
    os.remove(tmp_path / "3" / "default" / MANIFEST_NAME)
    rc, rows = run("ls", str(tmp_path), "--json")
    assert rc == 0 and [r["state"] for r in rows] == ["committed", "damaged", "damaged"], rows
    assert rows[0]["created"] == 1_700_000_000  # Orbax's commit time
    assert "item 'default'" in rows[1]["problem"] and m.objects[0] in rows[1]["problem"]
    assert "item 'default'" in rows[2]["problem"] and "data is gone" in rows[2]["problem"]
    rc, text = run("ls", str(tmp_path))
    assert text.count("DAMAGED") == 2 and "swept" not in text


def test_an_unfinalized_orbax_step_on_gcs_is_orbax_s_not_swept() -> None:
    # On GCS Orbax writes a step under its final name and finalises it with commit_success.txt.
    store = CheckpointStore("gs://bucket/run", backend=MemoryBackend("mem://newcomer-unfinalized"))
    meta = json.dumps({"item_handlers": {"extra": "x.JsonCheckpointHandler"}}).encode()

    async def put(key: str, data: bytes) -> None:
        await store.backend.write(key, [memoryview(data)])

    run_sync(put(f"5/{STEP_METADATA_NAME}", meta))
    run_sync(put("5/extra/metadata", b"{}"))
    st = run_sync(store.status("5"))
    assert st.state == "unfinalized" and st.orbax is not None and not st.orbax.finalized
    assert "gc" in st.problem and "leaves it alone" in st.problem
    run_sync(put(f"5/{COMMIT_SUCCESS_NAME}", b"ok"))
    st = run_sync(store.status("5"))
    assert st.state == "committed" and st.orbax is not None
    assert [it.name for it in st.orbax.items] == ["extra"]
    run_sync(store.close())


def test_a_step_directory_of_crashed_saves_is_still_uncommitted(tmp_path: Path) -> None:
    save(tmp_path, 1)
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "0123456789ab.h00000-00000").write_bytes(b"junk")
    rc, rows = run("ls", str(tmp_path), "--json")
    assert [r["state"] for r in rows] == ["committed", "incomplete"] and "orbax" not in rows[1]


# -- 2. A step directory where a root is expected ------------------------------------------------

def test_inspect_verify_ls_cp_convert_read_a_step_directory_as_root_and_step(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    for s in (10, 20, 30):
        save(ck, s, s)
    rc, doc = run("inspect", str(ck / "30"), "--json")
    assert rc == 0 and doc["step"] == 30, doc
    rc, doc = run("inspect", f"{ck}/20/", "--step", "20", "--json")  # the same step twice: fine
    assert rc == 0 and doc["step"] == 20
    rc, doc = run("verify", str(ck / "20"), "--json")
    assert rc == 0 and doc["ok"] and doc["url"] == f"{ck}/20"
    rc, rows = run("ls", str(ck / "20"), "--json")
    assert rc == 0 and [r["step"] for r in rows] == [20] and rows[0]["state"] == "committed"
    rc, rows = run("ls", str(ck), "--step", "10", "--json")
    assert rc == 0 and [r["step"] for r in rows] == [10]
    rc, doc = run("cp", str(ck / "20"), str(tmp_path / "copy"), "--json")
    assert rc == 0 and doc["step"] == 20 and doc["dst"] == f"{tmp_path / 'copy'}/20"
    assert np.array_equal(ckptio.restore(tmp_path / "copy", step=20)["w"], state(20)["w"])
    if importlib.util.find_spec("torch") is not None:
        rc, doc = run("convert", str(ck / "10"), str(tmp_path / "dcp"), "--from", "ckptio", "--to", "dcp",
                      "--json")
        assert rc == 0 and doc["step"] == 10, doc
    # Relative, from inside the root: `cd ck && ckptio inspect 30`.
    cwd = os.getcwd()
    try:
        os.chdir(ck)
        rc, doc = run("inspect", "30", "--json")
    finally:
        os.chdir(cwd)
    assert rc == 0 and doc["step"] == 30


def test_a_step_directory_with_another_step_option_is_one_usage_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(tmp_path, 30)
    save(tmp_path, 20)
    for cmd in ("inspect", "verify", "ls"):
        rc, _ = run(cmd, str(tmp_path / "30"), "--step", "20")
        line = one_error_line(capsys.readouterr().err)
        assert rc == EXIT_CODES["usage"] and f"{tmp_path / '30'} is step 30 of {tmp_path}" in line
        assert "--step 20" in line


def test_external_hashed_and_uncommitted_step_directories(tmp_path: Path) -> None:
    from ckptio.engine.layout import HashedNaming

    ckptio.save(tmp_path, state(4), step=4, naming=HashedNaming()).result()
    rc, doc = run("inspect", str(tmp_path / "4"), "--json")
    assert rc == 0 and doc["step"] == 4
    # A crashed save's step directory (no manifest): ls shows that step of the root.
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "0123456789ab.h00000-00000").write_bytes(b"junk")
    rc, rows = run("ls", str(tmp_path / "5"), "--json")
    assert rc == 0 and rows == [{"step": 5, "state": "incomplete", "committed": False}]


def test_a_checkpoint_saved_in_a_directory_named_like_a_step_stays_a_root(tmp_path: Path) -> None:
    save(tmp_path / "7", None, 7)  # its manifest records no step: a root of its own
    rc, doc = run("inspect", str(tmp_path / "7"), "--json")
    assert rc == 0 and doc["step"] is None
    rc, rows = run("ls", str(tmp_path / "7"), "--json")
    assert rc == 0 and [r["step"] for r in rows] == [None]
    save(tmp_path / "8", 3)  # a root whose directory is a number, holding steps
    rc, rows = run("ls", str(tmp_path / "8"), "--json")
    assert rc == 0 and [r["step"] for r in rows] == [3]


def test_ls_of_an_orbax_step_directory_shows_that_step(tmp_path: Path) -> None:
    orbax_step_by_hand(tmp_path, 1)
    orbax_step_by_hand(tmp_path, 2)
    rc, rows = run("ls", str(tmp_path / "2"), "--json")
    assert rc == 0 and [(r["step"], r["state"]) for r in rows] == [(2, "committed")]


# -- 3. Smaller ones ------------------------------------------------------------------------------

def test_convert_into_a_file_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    save(tmp_path / "ck", 1)
    (tmp_path / "afile.txt").write_text("x")
    rc, _ = run("convert", str(tmp_path / "ck"), str(tmp_path / "afile.txt"), "--from", "ckptio",
                "--to", "dcp")
    line = one_error_line(capsys.readouterr().err)
    assert rc == EXIT_CODES["usage"] and "afile.txt is a file" in line


def test_convert_api_raises_dcp_s_own_failure_not_its_wrapper(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ckptio.convert import convert

    save(tmp_path / "ck", 1)
    (tmp_path / "afile.txt").write_text("x")
    # DCP wraps it in CheckpointException, a BaseException that no `except Exception` catches.
    with pytest.raises(FileExistsError):
        convert(str(tmp_path / "ck"), str(tmp_path / "afile.txt"), src_format="ckptio", dst_format="dcp")


@pytest.mark.parametrize("src_format,dst_format", [("ckptio", "dcp"), ("dcp", "ckptio")])
def test_convert_of_a_missing_source_draws_no_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], src_format: str, dst_format: str
) -> None:
    rc, _ = run("convert", str(tmp_path / "nosuch"), str(tmp_path / "out"), "--from", src_format,
                "--to", dst_format)
    line = one_error_line(capsys.readouterr().err)  # the bar writes to stderr: none there
    assert rc == EXIT_CODES["not-found"] and "nosuch does not exist" in line
    assert not (tmp_path / "out").exists()


def test_cp_to_memory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(tmp_path, 1)
    for argv in (("cp", str(tmp_path), "mem://x"),
                 ("convert", str(tmp_path), "mem://y", "--from", "dcp", "--to", "ckptio")):
        rc, _ = run(*argv)
        line = one_error_line(capsys.readouterr().err)
        assert rc == EXIT_CODES["usage"] and "mem://" in line and "vanishes" in line, line


def test_help_of_gc_cp_convert_describes_them(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("gc", "cp", "convert"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        usage, _, rest = out.partition(" positional arguments:")
        assert len(usage.split(f"{cmd} [-h]", 1)[1].split("]", 1)[0]) < len(usage)  # sanity: a usage line
        description = usage.split("URL" if cmd == "gc" else "SRC DST", 1)[1].strip()
        assert len(description) > 40, (cmd, out)
        if cmd == "gc":
            assert "(default: 3600)" in rest
        if cmd == "convert":
            assert "the format of SRC" in rest and "the format to write DST in" in rest


def test_bench_errors_read_like_every_other_command(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ckptio.bench")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--nosuch"])
    assert e.value.code == EXIT_CODES["usage"]
    line = one_error_line(capsys.readouterr().err)
    assert "--nosuch" in line and "ckptio bench --help" in line
    assert main(["bench", "--cases", "nonesuch", "--no-progress"]) == EXIT_CODES["usage"]
    assert "nonesuch" in one_error_line(capsys.readouterr().err)
