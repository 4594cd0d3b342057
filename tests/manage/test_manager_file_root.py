"""issue 16: a CheckpointManager whose root is a file says so at once, naming the path, like ckptio.save."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ckptio


@pytest.mark.parametrize("where", ["f", "f/below"])
def test_manager_on_a_file_says_it_is_a_file(tmp_path: Path, where: str) -> None:
    (tmp_path / "f").write_text("not a directory")
    root = tmp_path / where
    with pytest.raises(NotADirectoryError) as err:
        ckptio.CheckpointManager(root, max_to_keep=2)
    said = str(err.value)
    assert str(root) in said and "not a directory" in said
    assert ("is a file" in said) if where == "f" else (f"lies under {tmp_path / 'f'}, which is a file" in said)
    assert (tmp_path / "f").read_text() == "not a directory"  # refused before touching anything


def test_manager_and_save_refuse_a_file_root_with_the_same_words(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError) as by_save:
        ckptio.save(tmp_path / "f", {"w": np.zeros(2)}, step=1)
    with pytest.raises(NotADirectoryError) as by_manager:
        ckptio.CheckpointManager(str(tmp_path / "f"))
    assert str(by_manager.value) == str(by_save.value)


def test_manager_on_a_directory_that_does_not_exist_yet_still_works(tmp_path: Path) -> None:
    with ckptio.CheckpointManager(tmp_path / "new" / "run") as mngr:
        mngr.save(1, {"w": np.arange(3)})
    assert ckptio.restore(tmp_path / "new" / "run", 1)["w"].tolist() == [0, 1, 2]
