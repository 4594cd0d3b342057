"""The writer process imports the trainer's own ckptio, whatever the working directory holds: a folder
named ``ckptio`` there (a clone of this repository, say) is never imported instead."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAINER = textwrap.dedent("""
    import sys, numpy as np, ckptio
    state = {"w": np.arange(1 << 20, dtype=np.float32)}
    ckptio.save(sys.argv[1], state, step=1, save_options=ckptio.SaveOptions(writer="sidecar")).result()
    assert ckptio.restore(sys.argv[1], 1)["w"].tolist() == state["w"].tolist()
    from ckptio.saving.writers import sidecar
    assert sidecar.current_pid() is not None  # the writer process wrote it
    print("ok")
""")


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs Linux memfd")
def test_a_folder_named_ckptio_in_the_working_directory_is_not_the_writer_process_ckptio(tmp_path: Path) -> None:
    decoy = tmp_path / "cwd" / "ckptio"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy ckptio of the working directory')\n")
    script = tmp_path / "trainer" / "train.py"
    script.parent.mkdir()
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=decoy.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
