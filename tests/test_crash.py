"""kill -9 during saves and retention: only committed checkpoints are listed, all restore bit-exact."""

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
