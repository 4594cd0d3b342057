"""The ``ckptio`` command: ls / inspect (--json content), verify (a flipped byte), cp (local <-> fake GCS).

``convert`` is exercised by tests/test_convert.py (and the Orbax worker).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from conftest import GCS_TEST_BUCKET

import ckptio
from ckptio.cli import main
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
    assert rows == [
        {"step": 1, "state": "committed", "committed": True, "items": 4, "objects": 1, "bytes": nbytes, "hosts": 1},
        {"step": 2, "state": "committed", "committed": True, "items": 4, "objects": 1, "bytes": nbytes, "hosts": 1},
        {"step": 3, "state": "incomplete", "committed": False},
    ]
    rc, text = run("ls", root)
    assert "UNCOMMITTED" in text and text.lower().count("committed") == 3
    save(str(tmp_path / "solo"), None)  # saved at the URL itself
    rc, rows = run("ls", str(tmp_path / "solo"), "--json")
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
    assert rc == 1 and not doc["ok"], doc
    assert doc["object"] == key and doc["item"] == "params/w" and doc["type"] == "IntegrityError", doc
    assert key in doc["error"] and "params/w" in doc["error"]
    rc, _ = run("verify", str(tmp_path), "--step", "1")
    err = capsys.readouterr().err
    assert rc == 1 and key in err and "'params/w'" in err


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
    assert rc == 0 and doc["written"] == 0
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
    assert rc == 1 and doc["type"] == "IntegrityError" and doc["object"] == key and doc["item"] == "params/w"
    assert not (dst / "2" / MANIFEST_NAME).exists()
    rc, doc = run("ls", str(dst), "--json")
    assert doc in ([], [{"step": 2, "state": "incomplete", "committed": False}])
