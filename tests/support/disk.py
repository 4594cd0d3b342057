"""Disk space for the tests that write GiBs: CI machines may have only a few GiB free."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def free_gib(path: str | Path) -> float:
    """GiB free on the file system that holds ``path``."""
    return shutil.disk_usage(path).free / 2**30


def disk_free_at_least(path: str | Path, gib: float, what: str) -> None:
    """Fail the calling test at once, with one line naming the need, when ``path``'s file system has less
    than ``gib`` GiB free: a test that ran out midway would fail on a confusing ENOSPC instead."""
    have = free_gib(path)
    if have < gib:
        pytest.fail(f"{what} need {gib:.1f} GiB free under {path}; {have:.1f} GiB is free", pytrace=False)
