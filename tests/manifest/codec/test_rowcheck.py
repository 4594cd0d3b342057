"""The rows gathered from columnar fragments are checked all at once (manifest.codec.rowcheck):
a bad row is refused naming its own item -- the first bad one in the root's order, for the first
check it fails -- however many items and fragments there are and wherever the chunks fall, and
good rows make the same tables as their shards."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptio.errors import ManifestError
from ckptio.manifest import ArrayItem, FragmentRef, Manifest
from ckptio.manifest.codec import rowcheck
from ckptio.manifest.codec.columns import decode_columns, encode_columns, from_columns
from ckptio.manifest.codec.gather import Gather

ROWS = 4  # rows of each array per fragment


def _manifest(n_items: int, n_frag: int, dtypes: list[str]) -> tuple[Manifest, list[list[tuple[str, list[dict]]]]]:
    """``n_items`` row-sharded arrays (mixed ranks: even items 2-d, odd 1-d), each fragment
    holding ``ROWS`` rows of every one, and every fragment's host-record rows."""
    items: dict[str, ArrayItem] = {}
    frags: list[list[tuple[str, list[dict]]]] = [[] for _ in range(n_frag)]
    for k in range(n_items):
        dt = np.dtype(dtypes[k % len(dtypes)])
        shape = (n_frag * ROWS, 3) if k % 2 == 0 else (n_frag * ROWS,)
        item = ArrayItem(dt, shape, [])
        rows = []
        for f in range(n_frag):
            box = ([f * ROWS, 0], [ROWS, 3]) if k % 2 == 0 else ([f * ROWS], [ROWS])
            nbytes = int(np.prod(box[1])) * dt.itemsize
            rows.append([f, *box[0], *box[1]])
            frags[f].append((f"a{k}", [{"offsets": box[0], "shape": box[1],
                                        "extents": [[0, k * 64, 0, nbytes, [k]]]}]))
        item.locator = np.array(rows, np.int64)
        items[f"a{k}"] = item
    refs = [FragmentRef(f"frag{f}", 0, 0, f) for f in range(n_frag)]
    return Manifest(1, "c", 0.0, 4096, n_frag, None, items, [], fragments=refs, complete=False), frags


def _load(root: Manifest, frags: list[list[tuple[str, list[dict]]]]) -> dict[str, ArrayItem]:
    gather = Gather(list(root.items), None, len(frags))
    like = None
    for f, listed in enumerate(frags):
        like = decode_columns({"objects": ["o"], **encode_columns(listed)}, f"frag{f}", like, keep=set(root.items))
        gather.add(f, f, like)
    return from_columns(root, gather.done(), "root", complete=True)


FAULTS = {  # what a lying row says -> the message naming it
    "rank": (lambda r: {**r, "offsets": [*r["offsets"], 0], "shape": [*r["shape"], 2]}, "rank differs"),
    "outside": (lambda r: {**r, "offsets": [r["offsets"][0] + 1000, *r["offsets"][1:]]}, "outside the array"),
    "tile": (lambda r: {**r, "tile": [r["shape"][0] + 5, *r["shape"][1:]]}, "tile does not fit"),
    "extents": (lambda r: {**r, "extents": [[0, 0, 0, r["extents"][0][3] - 1, [1]]]}, "extents do not hold"),
    # Two faults in one row: the first check in order names it.
    "tile+extents": (lambda r: {**r, "tile": [r["shape"][0] + 5, *r["shape"][1:]],
                                "extents": [[0, 0, 0, r["extents"][0][3] - 1, [1]]]}, "tile does not fit"),
}


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.integers(1, 12), st.integers(1, 5), st.sampled_from([1, 2, 3, 7, 1 << 16]), st.data())
def test_a_bad_row_is_refused_naming_its_item(n_items: int, n_frag: int, chunk: int, data: st.DataObject) -> None:
    root, frags = _manifest(n_items, n_frag, ["float32", "int8", "float64"])
    old = rowcheck._CHUNK
    rowcheck._CHUNK = chunk  # rows of one item in several chunks, or several items in one
    try:
        good = _load(root, frags)
        for k in range(n_items):  # good rows: every array whole, each shard its own box and bytes
            t = good[f"a{k}"].table
            assert t is not None and t.n == n_frag
            assert sorted(t.offsets[:, 0].tolist()) == [f * ROWS for f in range(n_frag)]
        bad_items = sorted(data.draw(st.sets(st.integers(0, n_items - 1), min_size=1, max_size=3)))
        kinds = {k: data.draw(st.sampled_from(sorted(FAULTS))) for k in bad_items}
        for k in bad_items:
            f = data.draw(st.integers(0, n_frag - 1))
            name, rows = frags[f][k]
            frags[f][k] = (name, [FAULTS[kinds[k]][0](rows[0])])
        first = bad_items[0]
        with pytest.raises(ManifestError, match=f"item 'a{first}': a shard.*{FAULTS[kinds[first]][1]}"):
            _load(root, frags)
    finally:
        rowcheck._CHUNK = old


def test_gathering_reserves_a_bounded_guess_and_grows_past_it() -> None:
    """The first fragment's sizes times the fragments expected reserve at most about a GiB of
    address space (a huge first fragment times thousands must not be refused by the kernel);
    fragments beyond the guess grow the columns, and every row lands."""
    root, frags = _manifest(3, 5, ["float32"])
    gather = Gather(list(root.items), None, expect=10**9)
    like = None
    for f, listed in enumerate(frags):
        like = decode_columns({"objects": ["o"], **encode_columns(listed)}, f"frag{f}", like, keep=set(root.items))
        gather.add(f, f, like)
        assert gather.cols["crcs"].nbytes + gather.cols["extents"].nbytes + gather.cols["boxes"].nbytes <= 2 << 30
    cols = gather.done()
    assert len(cols["item"]) == 3 * 5 and cols["loaded"].tolist() == list(range(5))
    small = Gather(list(root.items), None, expect=1)  # a guess too small: the columns double
    like = None
    for f, listed in enumerate(frags):
        like = decode_columns({"objects": ["o"], **encode_columns(listed)}, f"frag{f}", like, keep=set(root.items))
        small.add(f, f, like)
    got = small.done()
    assert all(np.array_equal(got[k], cols[k]) for k in ("item", "frag", "boxes", "ecount", "extents", "crcs"))
