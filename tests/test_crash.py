"""kill -9 during saves, retention, gc and cp: only committed checkpoints are listed, all restore bit-exact,
nothing committed is lost, and a final gc leaves exactly the kept steps' bytes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from crash_campaign import run_campaign  # noqa: E402


@pytest.mark.slow
def test_kill_minus_9_campaign(tmp_path):
    result = run_campaign(trials=20, root=str(tmp_path / "ckpt"), seed=1234)
    assert result["trials"] == 20 and result["newest"] >= 2
    assert all(n > 0 for n in result["kills"].values())  # savers/deleters, gc and cp were all killed
    assert result["bytes_on_disk"] == result["bytes_of_kept_steps"]
