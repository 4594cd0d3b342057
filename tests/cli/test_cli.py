"""The ``ckptio`` command: ls / inspect (--json content), verify (a flipped byte), cp (local <-> fake GCS),
and its answers to the common mistakes: one line, a distinct exit status, JSON under --json.

``convert`` is exercised by tests/convert/test_convert.py (and the Orbax worker).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tests.conftest import GCS_TEST_BUCKET

import ckptio
from ckptio.cli import EXIT_CODES, main
from ckptio.engine import run_sync
from ckptio.manifest import MANIFEST_NAME
from ckptio.store import CheckpointStore

W = np.arange(48 * 16, dtype=np.float32).reshape(48, 16)


def state(i: int = 0) -> dict[str, Any]:
    pieces = [((slice(0, 20),), W[:20] + i), ((slice(20, 48),), W[20:] + i)]
    return {
        "params": {
            "w": ckptio.Sharded(W.shape, W.dtype, pieces),
            "b": (np.arange(16) / 7).astype(ml_dtypes.bfloat16),
        },
        "step": 100 + i,
        "note": "run",
    }


def run(*argv: str) -> tuple[int, Any]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    out = buf.getvalue()
    return rc, (json.loads(out) if "--json" in argv else out)


def save(url: str, step: int | None, i: int = 0) -> None:
    ckptio.save(url, state(i), step=step, engine_config=ckptio.EngineConfig(block_size=256)).result()


def test_ls_json_lists_committed_and_uncommitted_steps(tmp_path: Path) -> None:
    root = str(tmp_path)
    save(root, 1)
    save(root, 2, 1)
    os.makedirs(tmp_path / "3")  # a crashed save: a step directory without a manifest
    (tmp_path / "3" / "x.h00000-00000").write_bytes(b"junk")
    rc, rows = run("ls", root, "--json")
    assert rc == 0
    nbytes = W.nbytes + 16 * 2
    for r in rows[:2]:
        assert abs(r.pop("created") - time.time()) < 3600  # when it was saved (shown by plain `ls` too)
    assert rows == [
        {"step": 1, "state": "committed", "committed": True, "items": 4, "objects": 1, "bytes": nbytes, "hosts": 1},
        {"step": 2, "state": "committed", "committed": True, "items": 4, "objects": 1, "bytes": nbytes, "hosts": 1},
        {"step": 3, "state": "incomplete", "committed": False},
    ]
    rc, text = run("ls", root)
    assert "UNCOMMITTED" in text and text.lower().count("committed") == 3
    save(str(tmp_path / "solo"), None)  # saved at the URL itself
    rc, rows = run("ls", str(tmp_path / "solo"), "--json")
    rows[0].pop("created")
    assert rows == [{"step": None, "state": "committed", "committed": True, "items": 4, "objects": 1,
                     "bytes": nbytes, "hosts": 1}]


def test_inspect_json_describes_items_shards_hosts_and_checksums(tmp_path: Path) -> None:
    save(str(tmp_path), 7)
    rc, doc = run("inspect", str(tmp_path), "--json")  # newest step
    assert rc == 0 and doc["step"] == 7 and doc["hosts"] == 1 and doc["block_size"] == 256
    w = doc["items"]["params/w"]
    assert (w["dtype"], w["shape"], w["origin"]) == ("float32", [48, 16], "sharded")
    assert w["shards"] == [
        {"offsets": [0, 0], "shape": [20, 16], "host": 0},
        {"offsets": [20, 0], "shape": [28, 16], "host": 0},
    ]
    assert doc["items"]["params/b"]["dtype"] == "bfloat16"
    assert doc["items"]["step"] == {"value": "100"}
    assert doc["items"]["note"] == {"value": "'run'"}
    assert doc["bytes"] == W.nbytes + 32 and doc["bytes_per_host"] == {"0": W.nbytes + 32}
    # Every 256-byte block of every extent has a crc32c: 20*64/256 + 28*64/256 + 1 (bf16: 32 bytes).
    assert doc["checksums"] == {
        "algorithm": "crc32c",
        "block_size": 256,
        "blocks": 5 + 7 + 1,
        "status": "recorded",
        "manifest": "sealed",
    }
    rc, text = run("inspect", str(tmp_path), "--step", "7")
    assert "params/w: float32[48, 16] in 2 shard(s)" in text


def _flip_a_byte(root: Path, step: str, item: str) -> str:
    """Flip one byte of ``item``'s second shard in storage; returns the object's key."""
    m = run_sync(CheckpointStore(str(root)).read_manifest(step))
    e = m.items[item].shards[1].extents[0]
    key = m.objects[e.object]
    with open(root / key, "r+b") as f:
        f.seek(e.offset + 100)
        b = f.read(1)
        f.seek(e.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    return key


def test_verify_finds_a_flipped_byte_and_names_object_and_item(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(str(tmp_path), 1)
    rc, doc = run("verify", str(tmp_path), "--json")
    assert rc == 0 and doc["ok"] and doc["bytes"] == W.nbytes + 32
    key = _flip_a_byte(tmp_path, "1", "params/w")
    rc, doc = run("verify", str(tmp_path), "--json")
    assert rc == EXIT_CODES["damaged"] and not doc["ok"] and doc["kind"] == "damaged", doc
    assert doc["object"] == key and doc["item"] == "params/w" and doc["type"] == "IntegrityError", doc
    assert key in doc["error"] and "params/w" in doc["error"]
    rc, _ = run("verify", str(tmp_path), "--step", "1")
    err = capsys.readouterr().err
    assert rc == EXIT_CODES["damaged"] and key in err and "'params/w'" in err
    last = err.splitlines()[-1]  # after the progress bar and the "reading it once more" warnings
    assert last.startswith("ckptio: error: ") and key in last and "Traceback" not in err


@pytest.mark.gcs
def test_cp_local_to_gcs_to_local_verified_and_committed_last(tmp_path: Path, gcs_emulator_env: str) -> None:
    src, back = str(tmp_path / "src"), str(tmp_path / "back")
    gs = f"gs://{GCS_TEST_BUCKET}/cli-cp-{os.getpid()}-{tmp_path.name}"
    save(src, 5)
    rc, doc = run("cp", src, gs, "--json")
    assert rc == 0 and doc["ok"] and doc["step"] == 5 and doc["written"] == 1 and doc["dst"] == f"{gs}/5", doc
    gstore = CheckpointStore(gs)
    m = run_sync(gstore.read_manifest("5"))
    assert all(k.startswith("h") for k in m.objects)  # hashed names on the object store
    rc, doc = run("verify", gs, "--json")
    assert rc == 0 and doc["ok"]
    rc, doc = run("cp", src, gs, "--json")  # the same checkpoint is already there: nothing to do
    assert rc == 0 and doc["written"] == 0 and doc["already_complete"]
    rc, doc = run("cp", gs, back, "--step", "5", "--dst-step", "6", "--json")
    assert rc == 0 and doc["dst"] == f"{back}/6"
    got = ckptio.restore(back, step=6)
    assert np.array_equal(got["params"]["w"], W) and got["step"] == 100 and got["note"] == "run"
    # Another checkpoint at the destination: refused, not overwritten.
    save(str(tmp_path / "other"), 5, 1)
    rc, doc = run("cp", str(tmp_path / "other"), gs, "--json")
    assert rc == 1 and doc["type"] == "FileExistsError"


def test_cp_refuses_corrupt_source_and_commits_nothing(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    save(str(src), 2)
    key = _flip_a_byte(src, "2", "params/w")
    rc, doc = run("cp", str(src), str(dst), "--json")
    assert rc == EXIT_CODES["damaged"] and doc["type"] == "IntegrityError" and doc["object"] == key
    assert doc["item"] == "params/w"
    assert not (dst / "2" / MANIFEST_NAME).exists()
    rc, doc = run("ls", str(dst), "--json")
    assert doc in ([{"step": 2, "state": "incomplete", "committed": False}],) or doc["kind"] == "not-found"


# -- the common mistakes: one line naming the URL / step, a distinct exit status ----------------


def run_err(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert err.startswith("ckptio: error: ") and err.count("\n") == 1, err  # one line, no traceback
    return rc, err


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "gc"])
def test_a_path_that_does_not_exist_is_not_found(tmp_path: Path, cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope")
    rc, err = run_err(cmd, missing, capsys=capsys)
    assert rc == EXIT_CODES["not-found"] and f"{missing} does not exist" in err


def test_ls_on_a_file_or_a_directory_without_checkpoints_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f").write_text("x")
    rc, err = run_err("ls", str(tmp_path / "f"), capsys=capsys)
    assert rc == EXIT_CODES["not-found"] and "is a file" in err
    (tmp_path / "d" / "notes").mkdir(parents=True)
    rc, err = run_err("ls", str(tmp_path / "d"), capsys=capsys)
    assert rc == EXIT_CODES["not-found"] and "holds no ckptio checkpoint" in err and str(tmp_path / "d") in err


def test_a_missing_step_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(str(tmp_path), 1)
    for cmd in ("inspect", "verify"):
        rc, err = run_err(cmd, str(tmp_path), "--step", "9", capsys=capsys)
        assert rc == EXIT_CODES["not-found"] and str(tmp_path / "9") in err


def test_a_damaged_manifest_is_damaged_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(str(tmp_path), 1)
    (tmp_path / "1" / MANIFEST_NAME).write_text("{")
    rc, err = run_err("inspect", str(tmp_path), "--step", "1", capsys=capsys)
    assert rc == EXIT_CODES["damaged"] and MANIFEST_NAME in err


def test_json_errors_are_json(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    for argv in (("verify", missing, "--json"), ("inspect", missing, "--json"), ("ls", missing, "--json"),
                 ("cp", missing, str(tmp_path / "dst"), "--json")):
        rc, doc = run(*argv)
        assert rc == EXIT_CODES["not-found"] and doc["ok"] is False and doc["kind"] == "not-found", doc
        assert missing in doc["error"] and doc["exit"] == rc
    rc, doc = run("inspect", missing, "--step", "x", "--json")
    assert rc == EXIT_CODES["usage"] and doc["kind"] == "usage" and "--step" in doc["error"]


def test_unknown_scheme_is_a_usage_error_and_s3_points_at_fsspec(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_err("ls", "s3://bucket/run", capsys=capsys)
    assert rc == EXIT_CODES["usage"] and "fsspec+s3://bucket/run" in err
    rc, err = run_err("ls", "nonesuch://x", capsys=capsys)
    assert rc == EXIT_CODES["usage"] and "'nonesuch'" in err and "fsspec+" in err  # the known schemes


def test_gcs_without_credentials_is_denied_in_one_line_and_closes_its_session(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")}
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="True", GCE_METADATA_HOST="127.0.0.1:9")
    p = subprocess.run([sys.executable, "-m", "ckptio.cli", "ls", "gs://no-such-bucket/run"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in (EXIT_CODES["denied"], EXIT_CODES["unreachable"]), p.stderr
    assert p.stderr.startswith("ckptio: error: gs://no-such-bucket/run") and p.stderr.count("\n") == 1, p.stderr
    assert "Unclosed" not in p.stderr


def test_an_emulator_nobody_listens_on_is_unreachable(tmp_path: Path) -> None:
    env = {**os.environ, "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}
    p = subprocess.run([sys.executable, "-m", "ckptio.cli", "inspect", "gs://b/run", "--json"], env=env,
                       capture_output=True, text=True, timeout=300)
    doc = json.loads(p.stdout)
    assert p.returncode == EXIT_CODES["unreachable"] and doc["kind"] == "unreachable" and "gs://b/run" in doc["error"]
    assert "Unclosed" not in p.stderr and "Traceback" not in p.stderr


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="does not exist"):
        main(["--debug", "ls", str(tmp_path / "nope")])
    with pytest.raises(Exception, match="does not exist"):
        main(["ls", str(tmp_path / "nope"), "--debug"])


def test_version_and_help_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ckptio {ckptio.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":mod:" not in out and ":func:" not in out and "exit status" in out
    for cmd in ("ls", "inspect", "verify", "gc", "cp", "convert"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["gc", "--help"])
    assert "--dry-run" in capsys.readouterr().out


def test_a_usage_error_is_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_err("ls", capsys=capsys)
    assert rc == EXIT_CODES["usage"] and "URL" in err
    rc, err = run_err("frobnicate", capsys=capsys)
    assert rc == EXIT_CODES["usage"]


def test_cp_a_second_time_says_already_complete(tmp_path: Path) -> None:
    save(str(tmp_path / "src"), 3)
    rc, text = run("cp", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert rc == 0 and "1 objects written" in text
    rc, text = run("cp", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert rc == 0 and "already complete" in text and "0 objects written" not in text


def test_cp_into_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(str(tmp_path / "src"), 3)
    (tmp_path / "f").write_text("x")
    rc, err = run_err("cp", str(tmp_path / "src"), str(tmp_path / "f"), capsys=capsys)
    assert rc == EXIT_CODES["usage"] and f"{tmp_path / 'f'} is a file" in err


def test_ls_shows_size_time_and_state_per_step(tmp_path: Path) -> None:
    save(str(tmp_path), 4)
    rc, text = run("ls", str(tmp_path))
    line = [ln for ln in text.splitlines() if ln.strip().startswith("4 ")][0]
    assert "committed" in line and "MiB" in line and time.strftime("%Y-%m-%d") in line
