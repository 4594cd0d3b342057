"""States of many small leaves (issue 15): packed staging, compact manifest rows, bulk restores.

Small whole arrays are staged back to back in packs (one copy, one extent, a checksum per
member), written as compact rows in the manifest and restored in bulk as views of one read
buffer. These tests hold that to the same promises as any other array: bit-exact round trips
of every dtype and shape, a flipped byte caught and named, nothing shared between restored
arrays that the caller could trip over.
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from manifests import manifest_doc, packed

import ckptio
from ckptio.manifest import PACKS_VERSION

_DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.uint16, np.int64, np.bool_,
           np.complex64, ml_dtypes.float8_e4m3fn]


def _mixed_state(n: int, seed: int = 0) -> dict:
    """``n`` leaves: every dtype above in odd sizes (so members land unaligned after each other),
    0-d arrays, zero-size arrays, numpy scalars, Python values, and a few arrays too big to pack."""
    rng = np.random.default_rng(seed)
    layers: dict[str, dict] = {}
    for i in range(n):
        layer = layers.setdefault(f"layer{i // 100}", {})
        kind = i % 13
        if kind == 10:
            leaf: object = np.zeros((0, 3), np.float32) if i % 2 else np.zeros(0, ml_dtypes.bfloat16)
        elif kind == 11:
            leaf = np.float32(i) if i % 2 else np.int64(-i)
        elif kind == 12:
            leaf = {"count": i, "name": f"p{i}", "lr": 0.5 ** (i % 7)}
        else:
            dt = np.dtype(_DTYPES[kind % len(_DTYPES)])
            shape = () if i % 29 == 0 else (1 + i % 7,) if i % 3 else (1 + i % 5, 1 + i % 3)
            raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
            leaf = raw.view(dt).reshape(shape)
        layer[f"p{i % 100}"] = leaf
    layers["big"] = {"w": rng.standard_normal((300, 300)).astype(np.float32)}  # 351 KiB: staged alone
    return layers


def _same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (np.ndarray, np.generic)):
        assert type(b) is type(a) and b.dtype == a.dtype and b.shape == a.shape, (where, b)
        assert np.asarray(b).tobytes() == np.asarray(a).tobytes(), where
    else:
        assert type(b) is type(a) and b == a, where


_manifest_doc = manifest_doc


@pytest.mark.slow  # 100k leaves
def test_a_hundred_thousand_mixed_leaves_round_trip_bit_exact(tmp_path: Path) -> None:
    state = _mixed_state(100_000)
    ckptio.save(tmp_path, state, step=1).result()
    _same(state, ckptio.restore(tmp_path))
    doc = _manifest_doc(tmp_path, 1)
    assert doc["version"] == PACKS_VERSION
    assert len(packed(doc)) > 60_000  # the small arrays are members of pack tables
    assert isinstance(doc["items"]["big/w"], dict)  # the big one is a full item
    # Into numpy targets of the same shapes: every leaf lands where it belongs.
    target = {k: {n: np.empty_like(v) if isinstance(v, np.ndarray) else v for n, v in layer.items()}
              for k, layer in state.items()}
    _same(state, ckptio.restore(tmp_path, target=target))


def test_packs_split_over_objects_when_they_pass_the_object_size(tmp_path: Path) -> None:
    state = {f"p{i}": np.full(300 + i % 5, i, np.int32) for i in range(3000)}  # ~3.6 MB in 1 MiB objects
    ckptio.save(tmp_path, state, step=1, backend_options={"object_size": 1 << 20}).result()
    objects = [f for f in os.listdir(tmp_path / "1") if not f.startswith("ckptio.")]
    assert len(objects) >= 4
    _same(state, ckptio.restore(tmp_path))


def test_restored_small_arrays_are_independent_writeable_and_aligned(tmp_path: Path) -> None:
    # A 3-byte array then float64s: the float64 after it sits at an odd offset of the pack.
    state = {"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.float64), "c": np.arange(4.0)}
    ckptio.save(tmp_path, state, step=1).result()
    out = ckptio.restore(tmp_path)
    _same(state, out)
    for arr in out.values():
        assert arr.flags.writeable and arr.flags.aligned
    out["b"][:] = -1
    _same(state["a"], out["a"])
    _same(state["c"], out["c"])


def test_packs_hold_one_dtype_so_every_member_is_aligned_in_its_object(tmp_path: Path) -> None:
    # Interleaved odd-sized dtypes: each dtype's members go to a pack of their own, back to back,
    # so every member's offset is a multiple of its itemsize and restores view it in place.
    state = {f"p{i}": np.arange(1 + i % 7, dtype=[np.uint8, np.float64, np.int16][i % 3]) for i in range(300)}
    ckptio.save(tmp_path, state, step=1).result()
    members = packed(_manifest_doc(tmp_path, 1))
    for name, arr in state.items():
        assert members[name]["offset"] % arr.dtype.itemsize == 0, name
    _same(state, ckptio.restore(tmp_path))


def test_a_numpy_only_state_of_mixed_dtypes_packs_in_bulk_bit_exact(tmp_path: Path) -> None:
    # Only numpy arrays (the packer's array-at-a-time path): every dtype, 0-d, zero-size and
    # too-big arrays among them, in a nested tree.
    rng = np.random.default_rng(1)
    state: dict = {}
    for i in range(3000):
        dt = np.dtype(_DTYPES[i % len(_DTYPES)])
        shape = (0,) if i % 97 == 0 else () if i % 31 == 0 else (1 + i % 9,)
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        state.setdefault(f"l{i // 50}", {})[f"p{i % 50}"] = raw.view(dt).reshape(shape)
    state["big"] = rng.standard_normal(70_000)  # 547 KiB: staged alone
    ckptio.save(tmp_path, state, step=1).result()
    members = packed(_manifest_doc(tmp_path, 1))
    assert "big" not in members and "l0/p0" not in members  # zero-size: an item of its own
    assert len(members) > 2900
    _same(state, ckptio.restore(tmp_path))


def test_an_unsavable_dtype_among_many_numpy_leaves_is_refused_naming_it(tmp_path: Path) -> None:
    state = {f"p{i}": np.arange(3, dtype=np.float32) for i in range(100)}
    state["p57"] = np.array([object()], dtype=object)
    with pytest.raises(TypeError, match="p57"):
        ckptio.save(tmp_path, state, step=1)
    assert not (tmp_path / "1").exists() or not any((tmp_path / "1").iterdir())


def test_non_contiguous_small_leaves_are_packed_in_c_order(tmp_path: Path) -> None:
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    state = {"fortran": np.asfortranarray(base[:3, :4]), "strided": base[::2, ::3], "t": base.T,
             "plain": base[0].copy()}
    assert not state["strided"].flags.c_contiguous and not state["t"].flags.c_contiguous
    ckptio.save(tmp_path, state, step=1).result()
    assert packed(_manifest_doc(tmp_path, 1)).keys() == state.keys()  # all packed
    out = ckptio.restore(tmp_path)
    for k, v in state.items():
        assert out[k].shape == v.shape and np.array_equal(out[k], v), k


def test_a_wide_state_changed_after_save_returns_is_saved_as_it_was(tmp_path: Path) -> None:
    # The structure of a wide dict is built off the step's path, from what save() captured.
    state = {f"w{i}": np.full(4, i, np.int64) for i in range(1000)}
    want = {k: v.copy() for k, v in state.items()}
    with ckptio.CheckpointManager(tmp_path) as mngr:
        handle = mngr.save(1, state)
        state["w0"][:] = -1
        state["extra"] = np.zeros(3)
        del state["w1"]
        state["w2"] = np.ones(2)
        handle.result()
    _same(want, ckptio.restore(tmp_path, 1))


def test_wide_dicts_with_keys_that_need_escaping_keep_their_names(tmp_path: Path) -> None:
    state = {"a/b": np.arange(3), "50%": np.arange(2), **{f"k{i}": np.arange(i % 4 + 1) for i in range(20)}}
    ckptio.save(tmp_path, state, step=1).result()
    assert {"a%2Fb", "50%25"} <= packed(_manifest_doc(tmp_path, 1)).keys()
    _same(state, ckptio.restore(tmp_path))


def test_a_flipped_byte_in_one_small_array_is_caught_naming_it(tmp_path: Path) -> None:
    state = {f"p{i}": np.full(100, i, np.float32) for i in range(50)}
    ckptio.save(tmp_path, state, step=1).result()
    doc = _manifest_doc(tmp_path, 1)
    obj, offset = packed(doc)["p17"]["object"], packed(doc)["p17"]["offset"]
    path = tmp_path / doc["objects"][obj]
    with open(path, "r+b") as f:
        f.seek(offset + 123)
        byte = f.read(1)
        f.seek(offset + 123)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ckptio.IntegrityError) as e:
        ckptio.restore(tmp_path)
    assert e.value.item == "p17" and doc["objects"][obj] in str(e.value)
    # The others still restore one by one (the damage is confined to its own checksum).
    assert ckptio.restore(tmp_path, target={"p16": np.empty(100, np.float32)})["p16"][0] == 16


def test_torch_and_numpy_small_leaves_pack_together_and_come_back_as_their_kind(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    state = {"t": torch.arange(7, dtype=torch.bfloat16), "n": np.arange(5, dtype=np.int16),
             "p": torch.nn.Parameter(torch.ones(3)), "s": np.float32(2.5)}
    ckptio.save(tmp_path, state, step=1).result()
    assert packed(_manifest_doc(tmp_path, 1))["t"]["origin"] == "torch"  # its pack's origin
    target = {"t": torch.zeros(7, dtype=torch.bfloat16), "n": np.zeros(5, np.int16),
              "p": torch.zeros(3), "s": np.float32(0)}
    out = ckptio.restore(tmp_path, target=target)
    assert torch.equal(out["t"], state["t"]) and torch.equal(out["p"], state["p"].detach())
    _same(state["n"], out["n"])
    assert out["s"] == np.float32(2.5)


def test_a_reader_that_predates_pack_tables_refuses_the_checkpoint(tmp_path: Path) -> None:
    """Format 5 (pack tables) is refused by a ckptio that reads at most 4, instead of missing items."""
    from ckptio.manifest import formats as manifest

    ckptio.save(tmp_path, {"a": np.arange(4.0)}, step=1).result()
    old = manifest.VERSION
    manifest.VERSION = 4
    try:
        with pytest.raises(ckptio.ManifestError, match="version 5 is not supported"):
            ckptio.restore(tmp_path)
    finally:
        manifest.VERSION = old


def test_gc_stays_enabled_after_saves_and_restores_and_a_callers_disable_is_kept(tmp_path: Path) -> None:
    import gc

    ckptio.save(tmp_path, {"a": np.arange(4.0)}, step=1).result()
    ckptio.restore(tmp_path)
    assert gc.isenabled()
    gc.disable()
    try:
        ckptio.save(tmp_path, {"a": np.arange(4.0)}, step=2).result()
        ckptio.restore(tmp_path)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_many_small_jax_leaves_pack_and_come_back_on_their_shardings(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    from jax.sharding import NamedSharding, PartitionSpec

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(3)
    dtypes = [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_, np.uint8]
    state = {
        f"l{i}": jax.device_put(rng.integers(0, 2, size=1 + i % 9).astype(dtypes[i % len(dtypes)]),
                                replicated if i % 2 else devices[0])
        for i in range(2000)
    }
    state["key"] = jax.random.key(7)
    state["sharded"] = jax.device_put(np.arange(8 * 64, dtype=np.float32).reshape(8 * len(devices), -1)[: 8 * len(devices)],
                                      NamedSharding(mesh, PartitionSpec("x")))
    ckptio.save(tmp_path, state, step=1).result()
    assert packed(_manifest_doc(tmp_path, 1))["l5"]["origin"] == "jax"
    target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    out = ckptio.restore(tmp_path, target=target)
    for name, want in state.items():
        got = out[name]
        assert isinstance(got, jax.Array) and got.sharding == want.sharding, name
        if name == "key":
            assert np.array_equal(jax.random.key_data(got), jax.random.key_data(want))
        else:
            assert got.dtype == want.dtype and np.asarray(got).tobytes() == np.asarray(want).tobytes(), name
