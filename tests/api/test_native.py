"""Native save/restore: every dtype and edge case bit-exact, resharding, integrity, bad input."""

from __future__ import annotations

import itertools
import json
import os

import hypothesis
import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import pytest
from manifests import as_rows

import ckptio
from ckptio.manifest import MANIFEST_NAME, seal, unseal
from ckptio.manifest.names import FENCE_PREFIX
from ckptio.state.dtypes import ML_DTYPES


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _random(shape: tuple[int, ...], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype.kind == "U":  # must be valid code points
        return rng.integers(32, 0x10FFFF // 2, size=shape).astype(np.uint32).view(dtype.newbyteorder("=")).astype(dtype) if False else np.array(["ab\u00e9"] * int(np.prod(shape)), dtype).reshape(shape)
    return raw.view(dtype).reshape(shape)


NUMPY_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.clongdouble,
    ">i4", ">f8", "M8[ns]", "m8[s]", "S7", "U5", "V6", np.dtype([("a", "<i4"), ("b", "<f8", (2,))]),
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES + sorted(ML_DTYPES), ids=str)
def test_round_trip_every_dtype_bit_exact(tmp_path, dtype):
    dtype = np.dtype(getattr(ml_dtypes, dtype) if isinstance(dtype, str) and dtype in ML_DTYPES else dtype)
    rng = np.random.default_rng(0)
    state = {"x": _random((7, 5), dtype, rng), "empty": np.zeros((0, 3), dtype), "scalar0d": _random((), dtype, rng)}
    ckptio.save(tmp_path, state, step=1).result()
    out = ckptio.restore(tmp_path)
    for k in state:
        assert _bits_equal(out[k], state[k]), k


def test_values_structure_and_edge_cases(tmp_path):
    base = np.arange(48, dtype=np.float32).reshape(6, 8)
    state = {
        "noncontig": base[::2, 1::3],
        "transposed": base.T,
        "numpy_scalar": np.float32(2.5),
        "values": [1, -(2**80), 1.0 / 3, float("nan"), float("-inf"), True, False, "héllo", b"\x00\xff", None],
        "nested": {"tuple": (np.int8(1), {"deep": [np.zeros(0)]}), "slash/key": np.ones(2), "%": 3},
        "empty_list": [],
        "empty_dict": {},
    }
    ckptio.save(tmp_path, state, step=3).result()
    out = ckptio.restore(tmp_path, step=3)
    assert _bits_equal(out["noncontig"], np.ascontiguousarray(state["noncontig"]))
    assert _bits_equal(out["transposed"], np.ascontiguousarray(base.T))
    assert isinstance(out["numpy_scalar"], np.float32) and out["numpy_scalar"] == np.float32(2.5)
    v = out["values"]
    assert v[:3] == [1, -(2**80), 1.0 / 3] and np.isnan(v[3]) and v[4] == float("-inf")
    assert v[5:] == [True, False, "héllo", b"\x00\xff", None]
    assert type(v[5]) is bool and type(v[0]) is int
    assert isinstance(out["nested"]["tuple"], tuple)
    assert out["nested"]["tuple"][1]["deep"][0].shape == (0,)
    assert _bits_equal(out["nested"]["slash/key"], np.ones(2))
    assert out["nested"]["%"] == 3
    assert out["empty_list"] == [] and out["empty_dict"] == {}


def test_staging_copies_mutable_arrays(tmp_path):
    a = np.zeros(1000, np.int64)
    h = ckptio.save(tmp_path, {"a": a}, step=0)
    a[:] = 7  # the training step goes on and mutates its arrays
    h.result()
    assert (ckptio.restore(tmp_path)["a"] == 0).all()


@pytest.mark.slow
def test_array_over_2gib(tmp_path):
    n = (2 << 30) + 4099
    big = np.empty(n, np.uint8)
    big[::4096] = np.arange(len(big[::4096]), dtype=np.uint64).astype(np.uint8)
    big[-5:] = [1, 2, 3, 4, 5]
    ckptio.save(tmp_path, {"big": big}, step=1, copy=False).result()
    out = ckptio.restore(tmp_path)["big"]
    assert out.shape == big.shape and np.array_equal(out[::4096], big[::4096]) and (out[-5:] == big[-5:]).all()
    del out
    # A slice of it restores by ranged reads.
    part = ckptio.restore(tmp_path, target={"big": ckptio.Sharded((n,), np.uint8, [((slice(n - 10, n),), None)])})
    assert (part["big"].pieces[0][1] == big[n - 10 :]).all()


def _saved_grid(tmp_path, shape=(64, 48), blocks=4, dtype=np.float32, block_size=None):
    """Save a global array as `blocks` row shards (as 4 hosts would), return it."""
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape).astype(dtype)
    rows = shape[0] // blocks
    pieces = [((slice(i * rows, (i + 1) * rows), slice(None)), full[i * rows : (i + 1) * rows]) for i in range(blocks)]
    cfg = ckptio.EngineConfig(block_size=block_size) if block_size else None
    ckptio.save(tmp_path, {"w": ckptio.Sharded(shape, dtype, pieces)}, step=5, engine_config=cfg).result()
    return full


@pytest.mark.parametrize("block_size", [None, 256, 1000])
def test_reshard_rows_to_columns_and_odd_boxes(tmp_path, block_size):
    full = _saved_grid(tmp_path, block_size=block_size)
    cols = [(slice(None), slice(j * 12, (j + 1) * 12)) for j in range(4)]
    odd = [(slice(3, 50), slice(5, 47)), (slice(63, 64), slice(0, 48)), (slice(10, 11), slice(7, 8))]
    for layout in (cols, odd):
        out = ckptio.restore(tmp_path, target={"w": ckptio.Sharded(full.shape, full.dtype, [(ix, None) for ix in layout])})
        for ix, data in out["w"].pieces:
            assert _bits_equal(data, np.ascontiguousarray(full[ix])), ix
    whole = ckptio.restore(tmp_path)["w"]
    assert _bits_equal(whole, full)
    into = np.empty_like(full)
    assert ckptio.restore(tmp_path, target={"w": into})["w"] is into and _bits_equal(into, full)


def _object_files(root) -> list[str]:
    out = []
    for d, _dirs, files in os.walk(root):
        out += [os.path.join(d, f) for f in files if f != MANIFEST_NAME and not f.startswith(FENCE_PREFIX)]
    return sorted(out)


def test_flipped_byte_is_detected_naming_object_and_item(tmp_path):
    state = {"params": {"w": np.random.default_rng(1).random((256, 256))}, "b": np.ones(10)}
    ckptio.save(tmp_path, state, step=1).result()
    [obj] = _object_files(tmp_path)
    at = os.path.getsize(obj) // 2  # inside w's bytes (512 KiB of the object's ~516)
    with open(obj, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ckptio.IntegrityError) as e:
        ckptio.restore(tmp_path)
    msg = str(e.value)
    assert os.path.basename(obj) in msg and "params/w" in msg
    assert e.value.item == "params/w"


def test_truncated_object_is_an_error(tmp_path):
    ckptio.save(tmp_path, {"w": np.ones(10000)}, step=1).result()
    [obj] = _object_files(tmp_path)
    os.truncate(obj, 100)
    with pytest.raises(ckptio.IntegrityError, match="holds 100 bytes"):
        ckptio.restore(tmp_path)


class Opaque:
    pass


@pytest.mark.parametrize(
    "state, where",
    [
        ({"a": {"b": np.array([object(), 1], dtype=object)}}, "a/b"),
        ({"x": [1, Opaque()]}, "x/1"),
        ({"s": {1, 2}}, "s"),
        ({"d": {3: np.ones(1)}}, "d"),
    ],
)
def test_bad_leaves_name_their_path(tmp_path, state, where):
    with pytest.raises(TypeError, match=where):
        ckptio.save(tmp_path, state, step=1)
    assert not os.path.exists(tmp_path / "1" / MANIFEST_NAME)


def test_missing_and_uncommitted_checkpoints(tmp_path):
    with pytest.raises(ckptio.CheckpointNotFoundError, match=str(tmp_path)):
        ckptio.restore(tmp_path)
    ckptio.save(tmp_path, {"a": np.ones(3)}, step=1).result()
    with pytest.raises(ckptio.CheckpointNotFoundError, match="7"):
        ckptio.restore(tmp_path, step=7)
    # A step directory with objects but no manifest: an interrupted save.
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "junk.h00000-00000").write_bytes(b"x" * 10)
    with pytest.raises(ckptio.CheckpointNotFoundError, match="not committed"):
        ckptio.restore(tmp_path, step=2)
    assert ckptio.CheckpointManager(tmp_path).all_steps() == [1]
    assert (ckptio.restore(tmp_path)["a"] == 1).all()  # the newest *committed* one


def test_existing_checkpoint_is_never_overwritten(tmp_path):
    ckptio.save(tmp_path, {"a": np.ones(3)}, step=1).result()
    with pytest.raises(FileExistsError, match="already committed"):
        ckptio.save(tmp_path, {"a": np.zeros(3)}, step=1)
    assert (ckptio.restore(tmp_path)["a"] == 1).all()


def _edit_manifest(tmp_path, fn):
    """Edit a manifest as a bug or an attacker would: consistently, checksum included."""
    path = tmp_path / "1" / MANIFEST_NAME
    doc = json.loads(unseal(path.read_bytes(), "test"))
    fn(doc)
    path.write_bytes(seal(doc))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["objects"].__setitem__(0, "../../etc/passwd"), "escapes"),
        (lambda d: d["objects"].__setitem__(0, "/etc/passwd"), "escapes"),
        (lambda d: d.__setitem__("version", 99), "version 99"),
        (lambda d: d["items"]["a"].__setitem__("dtype", "|O8"), "allow-list"),
        (lambda d: d["items"]["a"].__setitem__("dtype", {"struct": [["x", "|O", []]], "offsets": [0], "itemsize": 8}), "allow-list"),
        (lambda d: d["items"]["a"].__setitem__("shape", [10**6]), "missing or overlapping"),
        (lambda d: d["items"]["a"]["shards"][0].__setitem__("offsets", [5]), "outside"),
        (lambda d: d["items"]["a"]["shards"][0]["extents"][0].__setitem__(0, 7), "extent object"),
        (lambda d: d.pop("items"), "malformed"),
    ],
)
def test_malformed_manifest_is_refused_naming_it(tmp_path, edit, match):
    ckptio.save(tmp_path, {"a": np.arange(40_000.0)}, step=1).result()  # too big for a pack: a full item
    _edit_manifest(tmp_path, edit)
    with pytest.raises(ckptio.ManifestError, match=match) as e:
        ckptio.restore(tmp_path, step=1)
    assert MANIFEST_NAME in str(e.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r.__setitem__(0, "|O8"), "allow-list"),
        (lambda r: r.__setitem__(1, [10**9]), "checksums"),  # 8 GB in one checksum block
        (lambda r: r.__setitem__(1, ["10"]), "shape"),
        (lambda r: r.__setitem__(2, 7), "extent object"),
        (lambda r: r.__setitem__(3, -1), "extent offset"),
        (lambda r: r.__setitem__(4, []), "checksums"),
        (lambda r: r.__setitem__(4, [2**40]), "checksums"),
        (lambda r: r.append({"origin": "pickle"}), "origin"),
        (lambda r: r.append({"colour": 1}), "malformed item row"),
        (lambda r: r.pop(), "malformed item row"),
    ],
)
def test_malformed_item_row_is_refused_naming_it(tmp_path, edit, match):
    """A small whole array is a compact row in the manifest; every field of it is checked."""
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    _edit_manifest(tmp_path, lambda d: edit(as_rows(d)["items"]["a"]))  # as format 4 wrote it
    with pytest.raises(ckptio.ManifestError, match=match) as e:
        ckptio.restore(tmp_path, step=1)
    assert MANIFEST_NAME in str(e.value) and "'a'" in str(e.value)


def test_a_format_4_checkpoint_of_rows_still_restores(tmp_path):
    state = {"a": np.arange(10.0), "b": {"c": np.arange(6, dtype=np.int8).reshape(2, 3)}, "big": np.ones(70000)}
    ckptio.save(tmp_path, state, step=1).result()
    _edit_manifest(tmp_path, as_rows)
    out = ckptio.restore(tmp_path, step=1)
    for got, want in ((out["a"], state["a"]), (out["b"]["c"], state["b"]["c"]), (out["big"], state["big"])):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def _table(d):
    (t,) = d["packs"]
    return t


def _dup(d):
    d["items"]["a"] = {"kind": "value", "type": "none"}


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.__setitem__("dtype", "|O8"), "allow-list"),
        (lambda t: t.__setitem__("shapes", [[10**9]]), "member 'a' of shape"),
        (lambda t: t.__setitem__("shapes", [["10"]]), "'shapes'"),
        (lambda t: t.__setitem__("shapes", [[]]), "member 'a' of shape"),
        (lambda t: t.__setitem__("object", 7), "'object'"),
        (lambda t: t.__setitem__("offset", -1), "'offset'"),
        (lambda t: t.__setitem__("crcs", []), "'crcs'"),
        (lambda t: t.__setitem__("crcs", [2**40]), "'crcs'"),
        (lambda t: t.__setitem__("ends", [2**20 + 8]), "member 'a' spans"),
        (lambda t: t.__setitem__("ends", [True]), "'ends'"),
        (lambda t: t.__setitem__("origin", "pickle"), "origin"),
        (lambda t: t.__setitem__("colour", 1), "malformed pack table"),
        (lambda t: t.pop("names"), "malformed pack table"),
        (lambda t: t.__setitem__("names", [5]), "'names'"),
        (lambda t: t.__setitem__("scalars", [0]), "'scalars'"),
    ],
)
def test_malformed_pack_table_is_refused_naming_it(tmp_path, edit, match):
    """Small whole arrays are members of a pack table (format 5); every column of it is checked."""
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    _edit_manifest(tmp_path, lambda d: edit(_table(d)))
    with pytest.raises(ckptio.ManifestError, match=match) as e:
        ckptio.restore(tmp_path, step=1)
    assert MANIFEST_NAME in str(e.value) and "pack 0" in str(e.value)


def test_a_packed_name_listed_twice_is_refused(tmp_path):
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    _edit_manifest(tmp_path, _dup)
    with pytest.raises(ckptio.ManifestError, match="item 'a' is listed twice"):
        ckptio.restore(tmp_path, step=1)


def test_garbage_manifest(tmp_path):
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    (tmp_path / "1" / MANIFEST_NAME).write_bytes(b"\x80not json")
    with pytest.raises(ckptio.ManifestError, match="not valid JSON"):
        ckptio.restore(tmp_path, step=1)
    (tmp_path / "1" / MANIFEST_NAME).write_bytes(seal({"format": "ckptio"})[:-1] + b"x")
    with pytest.raises(ckptio.ManifestError):
        ckptio.restore(tmp_path, step=1)


def test_flipped_byte_in_manifest_is_detected(tmp_path):
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    path = tmp_path / "1" / MANIFEST_NAME
    data = bytearray(path.read_bytes())
    i = data.index(b'"shapes":[[10]]') + len('"shapes":[[')  # a pack table's member (ckptio.manifest.codec.packs)
    data[i] = ord("2")  # still valid JSON, wrong shape
    path.write_bytes(bytes(data))
    with pytest.raises(ckptio.IntegrityError, match="manifest"):
        ckptio.restore(tmp_path, step=1)


def test_target_mismatch_names_item(tmp_path):
    ckptio.save(tmp_path, {"a": np.arange(10.0)}, step=1).result()
    with pytest.raises(ValueError, match="'a'"):  # another shape (another dtype is a checked cast)
        ckptio.restore(tmp_path, target={"a": np.empty(9)})
    with pytest.raises(ckptio.CheckpointNotFoundError, match="'b'"):
        ckptio.restore(tmp_path, target={"b": np.empty(10)})


def test_memory_backend_url():
    state = {"w": np.arange(100, dtype=np.int32), "step": 4}
    ckptio.save("mem://native-test", state, step=4).result()
    out = ckptio.restore("mem://native-test")
    assert out["step"] == 4 and _bits_equal(out["w"], state["w"])


def test_unknown_scheme_names_url():
    with pytest.raises(ValueError, match="nosuch"):
        ckptio.save("nosuch://x", {"a": 1}, step=1)


def test_torch_tensors_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    state = {
        "bf16": torch.randn(16, 8).to(torch.bfloat16),
        "f8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "i": torch.arange(10),
        "b": torch.tensor([True, False]),
        "view": torch.arange(20.0).reshape(4, 5).t(),
    }
    ckptio.save(tmp_path, state, step=1).result()
    target = {k: torch.empty_like(v.contiguous()) for k, v in state.items()}
    out = ckptio.restore(tmp_path, target=target)
    for k, v in state.items():
        assert out[k] is target[k]
        assert torch.equal(out[k].view(torch.uint8) if v.dtype.itemsize == 1 and v.dtype != torch.bool else out[k], (v.contiguous().view(torch.uint8) if v.dtype.itemsize == 1 and v.dtype != torch.bool else v.contiguous())), k
    plain = ckptio.restore(tmp_path)
    assert plain["bf16"].dtype == ml_dtypes.bfloat16


def test_jax_arrays_round_trip_and_reshard(tmp_path):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    x = jnp.arange(8 * 16, dtype=jnp.bfloat16).reshape(8, 16)
    if len(devices) >= 4:
        mesh = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("a", "b"))
        x = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
    ckptio.save(tmp_path, {"x": x, "k": jax.random.key_data(jax.random.key(0))}, step=1).result()
    out = ckptio.restore(tmp_path)
    assert _bits_equal(out["x"], np.asarray(x))
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(devices[0]))}
    y = ckptio.restore(tmp_path, target=target)["x"]
    assert isinstance(y, jax.Array) and _bits_equal(np.asarray(y), np.asarray(x))


# -- the tiling check at scale ---------------------------------------------------------------------


def _brute_overlaps(boxes):
    from ckptio.manifest import overlap

    return any(overlap(*boxes[i], *boxes[j]) is not None for i in range(len(boxes)) for j in range(i))


@st.composite
def _box_sets(draw):
    """Small sets of boxes in 1-3 dimensions on a coarse lattice (so grids, bands and clashes all occur)."""
    ndim = draw(st.integers(1, 3))
    box = st.tuples(
        st.tuples(*[st.integers(0, 6).map(lambda v: v // 2 * 2) for _ in range(ndim)]),
        st.tuples(*[st.sampled_from([1, 2, 2, 4]) for _ in range(ndim)]),
    )
    return draw(st.lists(box, max_size=14))


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(boxes=_box_sets())
def test_first_overlap_agrees_with_the_pairwise_check(boxes):
    from ckptio.manifest import first_overlap, overlap

    found = first_overlap(boxes)
    assert (found is not None) == _brute_overlaps(boxes)
    if found is not None:
        assert overlap(*found[0], *found[1]) is not None


@pytest.mark.parametrize("layout", ["grid", "irregular"])
def test_tiling_check_of_8192_shards_finds_the_one_overlap(layout):
    """A parameter sharded over 1024 hosts x 8 devices: valid, then with one shard moved onto another."""
    from ckptio.manifest import ShardRecord, _check_tiling

    if layout == "grid":  # 128 x 64 blocks of 4 x 8
        shards = [ShardRecord((r * 4, c * 8), (4, 8), 0, []) for r in range(128) for c in range(64)]
    else:  # every row band split at its own column boundaries: no common grid
        shards = []
        for r in range(128):
            cut = 1 + r % 7
            cols = [0, cut] + [cut + 8 * k for k in range(1, 63)] + [512]
            shards += [ShardRecord((r * 4, a), (4, b - a), 0, []) for a, b in itertools.pairwise(cols)]
    shape = (512, 512)
    _check_tiling(shards, shape, "x")
    bad = list(shards)
    a, b = bad[5000], bad[5001]
    bad[5001] = ShardRecord(a.offsets, b.shape, 0, [])  # same volume, now overlapping its neighbour
    with pytest.raises(ckptio.ManifestError, match="overlap"):
        _check_tiling(bad, shape, "x")


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    rows=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    cols=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    query=st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(1, 12), st.integers(1, 12)),
)
def test_shard_index_finds_exactly_the_overlapping_shards(rows, cols, query):
    """The per-array index that planning uses returns what a scan of every shard would."""
    from ckptio.manifest import ArrayItem, ShardRecord, overlap
    from ckptio.restoring.reshard import shards_meeting

    r_off = [0, *itertools.accumulate(rows)]
    c_off = [0, *itertools.accumulate(cols)]
    shards = [
        ShardRecord((r_off[i], c_off[j]), (rows[i], cols[j]), 0, [])
        for i in range(len(rows))
        for j in range(len(cols))
    ]
    item = ArrayItem(np.dtype(np.float32), (r_off[-1], c_off[-1]), shards)
    off, shape = query[:2], query[2:]
    want = {(s.offsets, s.shape) for s in shards if overlap(s.offsets, s.shape, off, shape) is not None}
    assert {(s.offsets, s.shape) for s, _ in shards_meeting(item, off, shape)} == want
    assert all(o == overlap(s.offsets, s.shape, off, shape) for s, o in shards_meeting(item, off, shape))
