"""bench/resume_campaign.py's work directory (checkpoints and logs of every launch) goes at the
end of a campaign, whatever its outcome, unless ``--keep``."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pytest

from ckptio.bench import resume_campaign


@pytest.mark.parametrize("outcome", ["passes", "fails", "raises"])
@pytest.mark.parametrize("keep", [False, True])
def test_the_work_directory_goes_unless_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str,
                                            keep: bool) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made: list[str] = []

    def campaign(args: argparse.Namespace, work: str) -> int:  # what the launches leave there
        made.append(work)
        os.makedirs(os.path.join(work, "ckpt", "1"))
        Path(work, "campaign.log").write_text("{}\n")
        if outcome == "raises":
            raise KeyboardInterrupt
        return 0 if outcome == "passes" else 1

    monkeypatch.setattr(resume_campaign, "_campaign", campaign)
    args = argparse.Namespace(kind="torch", keep=keep)
    if outcome == "raises":
        with pytest.raises(KeyboardInterrupt):
            resume_campaign.drive(args)
    else:
        assert resume_campaign.drive(args) == (0 if outcome == "passes" else 1)
    assert len(made) == 1 and Path(made[0]).parent == tmp_path
    assert Path(made[0], "campaign.log").exists() == keep and list(tmp_path.iterdir()) == ([Path(made[0])] if keep else [])


def test_keep_is_a_flag_of_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(resume_campaign, "drive", lambda args: seen.append(args) or 0)
    assert resume_campaign.main(["--kind", "torch"]) == 0 and resume_campaign.main(["--keep"]) == 0
    assert [a.keep for a in seen] == [False, True]
