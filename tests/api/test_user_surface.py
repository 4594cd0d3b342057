"""What a new user meets first on the native API: exported names, clear errors for a wrong path,
``progress=True``, and read-only messages that name Hyperdisk ML only for a Hyperdisk ML URL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptio
from ckptio.backends.hyperdisk_ml import HyperdiskMLBackend


def test_the_names_the_readme_uses_are_exported_from_ckptio(tmp_path: Path) -> None:
    for name in ("HashedNaming", "FlatNaming", "FanoutNaming", "Naming", "Progress", "Sharded", "EngineConfig",
                 "CheckpointManager", "zarr_store"):
        assert hasattr(ckptio, name) and name in ckptio.__all__, name
    ckptio.save(str(tmp_path), {"w": np.arange(4)}, step=1, naming=ckptio.HashedNaming()).result()
    assert next(p for p in tmp_path.iterdir() if p.name.startswith("h"))  # hashed first component
    assert ckptio.restore(str(tmp_path), 1)["w"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("where", ["f", "f/below"])
def test_saving_into_a_file_says_it_is_a_file(tmp_path: Path, where: str) -> None:
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=r"is a file|which is a file"):
        ckptio.save(str(tmp_path / where), {"w": np.zeros(2)}, step=1)
    assert (tmp_path / "f").read_text() == "not a directory"


def test_progress_true_shows_a_bar_on_save_and_restore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    ckptio.save(str(tmp_path), state, step=1, progress=True).result()
    assert "save" in capsys.readouterr().err
    back = ckptio.restore(str(tmp_path), 1, progress=True)
    assert "restore" in capsys.readouterr().err and np.array_equal(back["w"], state["w"])
    seen: list[int] = []
    ckptio.restore(str(tmp_path), 1, progress=lambda _key, n: seen.append(n))
    assert sum(seen) == state["w"].nbytes


def _read_only_mount(tmp_path: Path, root: Path) -> str:
    info = tmp_path / "mountinfo"
    info.write_text("22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                    f"40 22 0:50 / {root} ro,nosuid shared:20 - ext4 /dev/sdb ro\n")
    return str(info)


def test_a_plain_read_only_directory_is_not_called_hyperdisk_ml(tmp_path: Path) -> None:
    root = tmp_path / "ro"
    info = _read_only_mount(tmp_path, root)
    plain = HyperdiskMLBackend(str(root), mountinfo=info)  # what a plain path on a read-only mount gets
    with pytest.raises(PermissionError) as e:
        asyncio.run(plain.write("x", [memoryview(b"1")]))
    assert "Hyperdisk" not in str(e.value) and "read-only" in str(e.value) and str(root) in str(e.value)
    explicit = HyperdiskMLBackend(f"hdml://{root}", mountinfo=info)
    with pytest.raises(PermissionError, match="Hyperdisk ML volume is attached read-only"):
        asyncio.run(explicit.write("x", [memoryview(b"1")]))


def test_no_function_hides_a_package_and_the_functions_still_work(tmp_path: Path) -> None:
    """``ckptio.save`` and ``ckptio.restore`` are the functions; the packages are ``ckptio.saving`` and
    ``ckptio.restoring``, whose every module imports under an alias in a fresh interpreter."""
    names = sorted(p.stem for p in Path(ckptio.__file__).parent.joinpath("restoring").glob("*.py") if p.stem != "__init__")
    assert "batches" in names and not Path(ckptio.__file__).parent.joinpath("restore").exists()
    code = "\n".join([
        "import types",
        "import ckptio",
        *[f"import ckptio.restoring.{n} as m_{n}" for n in names],
        "assert isinstance(m_batches, types.ModuleType) and m_batches.__name__ == 'ckptio.restoring.batches'",
        "assert isinstance(ckptio.restore, types.FunctionType) and isinstance(ckptio.save, types.FunctionType)",
        f"assert ckptio.restore({str(tmp_path)!r}, 1)['w'].tolist() == [0, 1, 2, 3]",
    ])
    ckptio.save(str(tmp_path), {"w": np.arange(4)}, step=1).result()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
