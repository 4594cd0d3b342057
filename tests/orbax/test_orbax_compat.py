"""Issue 20, items 3-5: Orbax's shape changes, metadata API and topology check, in both adapter modes;
issue 16: clear errors for stock Orbax reading a register() item and for a file as the manager's root.

The scenarios (tests/scenarios/orbax_compat_scenarios.py) need 8 CPU devices, so they
run in one subprocess, as tests/orbax/test_orbax.py's do; this module reads their
verdicts and never imports jax itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.orbax.test_orbax import _check, _run_scenarios  # noqa: F401  (skips the module without jax/orbax)

pytestmark = pytest.mark.slow  # Orbax compatibility scenarios run as fresh JAX programs

SCENARIOS = [
    "reshape_save_restore",
    "reshape_type_handler",
    "metadata_api",
    "topology_mismatch",
    "stock_reads_register_item",
    "manager_root_is_a_file",
]


@pytest.fixture(scope="module")
def compat_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work: Path = tmp_path_factory.mktemp("orbax_compat")
    return _run_scenarios("orbax_compat_scenarios.py", SCENARIOS, work)


def test_restore_strict_false_pads_or_truncates_like_orbax(compat_results):
    """ckptio.orbax.Restore(strict=False): zero-padding and truncation per dimension, sharded and not,
    jax and numpy leaves, with a cast; target slices wholly beyond the saved array are zeros. strict=True
    (the default) and a change of rank raise, naming the item (was: any shape change raised)."""
    _check(compat_results, "reshape_save_restore")


def test_register_honours_array_restore_args_global_shape_and_strict(compat_results):
    """register(): ArrayRestoreArgs(global_shape, strict=False) and StandardRestore(strict=False) pad or
    truncate as Orbax does (its test_reshape_padding / _truncate / test_change_shape / test_transform);
    strict=True raises (was: 'ckptio does not pad or truncate' whatever strict said)."""
    _check(compat_results, "reshape_type_handler")


def test_metadata_is_orbax_tree_metadata_with_write_shape(compat_results):
    """handler.metadata() is a TreeMetadata (.tree, .custom_metadata) of ArrayMetadata with
    storage.write_shape (the saved shards' shape), ScalarMetadata and StringMetadata; item_metadata()
    is not None from the saving manager or a fresh one given the handler; it restores as a target."""
    _check(compat_results, "metadata_api")


def test_restore_without_target_detects_a_topology_mismatch(compat_results):
    """register(): StandardRestore() with jax.devices() mocked to one device raises 'Topology mismatch
    detected' (Orbax's test_topology_mismatch); with a target it restores. Save/Restore records no
    topology, so Restore() brings the array whole onto the default device (README)."""
    _check(compat_results, "topology_mismatch")


def test_stock_orbax_reading_a_register_item_is_told_to_call_register(compat_results):
    """An item written under ckptio.orbax.register(), restored by stock Orbax (ckptio not imported, or
    imported without register()), with or without a target, OCDBT or not, all-jax or mixed: the error
    says "call ckptio.orbax.register()" (was: NOT_FOUND ... .zarray, or Unknown type "ckptio.jax.Array");
    register() still restores it, and Orbax's "Skipping merge of OCDBT checkpoints" warning is gone."""
    _check(compat_results, "stock_reads_register_item")


def test_checkpoint_manager_refuses_a_file_as_its_directory(compat_results):
    """ckptio.orbax.CheckpointManager(path_of_a_regular_file) raises NotADirectoryError naming the path
    (was: accepted; the first save failed in a background thread)."""
    _check(compat_results, "manager_root_is_a_file")
