"""The dict model of a backend: a Hypothesis state machine that the conformance suite runs.

Each example gets fresh storage from the suite's ``make_backend`` and its own
event loop; every rule does one backend call and the same change to a dict,
and after every step the full listing must equal the dict.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ckptio.backends.base import ByteRange

if TYPE_CHECKING:
    from ckptio.testing._harness import ConformanceHarness

__all__ = ["BackendVsDict", "machine_for", "split_views"]

T = TypeVar("T")


def split_views(data: bytearray | memoryview, cuts: Sequence[int]) -> list[memoryview]:
    """Views of ``data`` cut at the sorted offsets ``cuts`` (repeated cuts give empty views)."""
    view = memoryview(data)
    edges = [0, *cuts, len(view)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


# Keys never name a "directory" of another key (a file system cannot hold both).
_SM_KEYS = ("k0", "k1", "a/k0", "a/k1", "a/b/k2", "b/c", "3f/step_1/obj")
_SM_PREFIXES = ("", "a", "a/", "a/b", "a/b/", "a/k", "k", "b", "3f/", "3f/step_1/", "zz")


def _children(model: dict[str, bytes], prefix: str) -> list[str]:
    base = prefix.rstrip("/") + "/" if prefix else ""
    return sorted({k[len(base) :].split("/", 1)[0] for k in model if k.startswith(base)})


_KEYS = st.sampled_from(_SM_KEYS)


class BackendVsDict(RuleBasedStateMachine):
    """Every rule does one backend call and the same change to a dict; the listing must match.

    :func:`machine_for` subclasses it with the suite and the storage to run on.
    """

    #: The suite whose ``make_backend`` each example opens, the directory examples live under,
    #: and a counter naming each example's own sub-directory.
    conformance: ClassVar[ConformanceHarness]
    storage_root: ClassVar[Path]
    examples: ClassVar[Iterator[int]]

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        root = self.storage_root / f"sm-{next(self.examples)}"
        root.mkdir()
        self.backend = self.loop.run_until_complete(self.conformance.open_backend(root))
        self.writer = self.conformance.seeder(self.backend)  # skips read-only backends with no writer
        self.model: dict[str, bytes] = {}

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(self.conformance.close_backend(self.backend))
        finally:
            self.loop.close()

    def do(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    def raises(self, exc: type[BaseException], coro: Awaitable[Any]) -> None:
        with pytest.raises(exc):
            self.do(coro)

    @rule(key=_KEYS, chunks=st.lists(st.binary(max_size=300), max_size=4))
    def write(self, key: str, chunks: list[bytes]) -> None:
        self.do(self.writer.write(key, [memoryview(c) for c in chunks]))
        self.model[key] = b"".join(chunks)

    @rule(key=_KEYS, dtype=st.sampled_from(["<f4", "<i2", "<f8"]), n=st.integers(0, 40))
    def write_array(self, key: str, dtype: str, n: int) -> None:
        arr = np.arange(n, dtype=dtype).reshape(-1, 1) * 3
        self.do(self.writer.write(key, [memoryview(arr)]))
        self.model[key] = arr.tobytes()

    @rule(key=_KEYS, data=st.binary(max_size=64))
    def create_if_absent(self, key: str, data: bytes) -> None:
        if key in self.model:
            self.raises(FileExistsError, self.writer.create_if_absent(key, data))
        else:
            self.do(self.writer.create_if_absent(key, data))
            self.model[key] = data

    @rule(key=_KEYS)
    def delete(self, key: str) -> None:
        if key in self.model:
            self.do(self.writer.delete(key))
            del self.model[key]
        else:
            self.raises(FileNotFoundError, self.writer.delete(key))

    @rule(key=_KEYS, data=st.data())
    def read_range(self, key: str, data: st.DataObject) -> None:
        if key not in self.model:
            self.raises(FileNotFoundError, self.backend.read_into(key, ByteRange(0, 0), []))
            return
        obj = self.model[key]
        start = data.draw(st.integers(0, len(obj)), label="start")
        end = data.draw(st.integers(start, len(obj)), label="end")
        cuts = sorted(data.draw(st.lists(st.integers(0, end - start), max_size=3), label="cuts"))
        dest = bytearray(end - start)
        self.do(self.backend.read_into(key, ByteRange(start, end), split_views(dest, cuts)))
        assert dest == obj[start:end]

    @rule(key=_KEYS, data=st.data())
    def read_past_end(self, key: str, data: st.DataObject) -> None:
        if key not in self.model:
            return
        size = len(self.model[key])
        end = data.draw(st.integers(size + 1, size + 8), label="end")
        start = data.draw(st.integers(0, end), label="start")
        self.raises(ValueError, self.backend.read_into(key, ByteRange(start, end), [memoryview(bytearray(end - start))]))

    @rule(key=_KEYS)
    def stat(self, key: str) -> None:
        if key in self.model:
            info = self.do(self.backend.stat(key))
            assert (info.key, info.size) == (key, len(self.model[key]))
        else:
            self.raises(FileNotFoundError, self.backend.stat(key))

    @rule(prefix=st.sampled_from(_SM_PREFIXES))
    def list_prefix(self, prefix: str) -> None:
        listed = self.do(self.backend.list(prefix))
        assert [(i.key, i.size) for i in listed] == sorted(
            (k, len(v)) for k, v in self.model.items() if k.startswith(prefix)
        )

    @rule(prefix=st.sampled_from(_SM_PREFIXES))
    def list_children(self, prefix: str) -> None:
        assert self.do(self.backend.list_children(prefix)) == _children(self.model, prefix)

    @rule()
    def sync(self) -> None:
        self.do(self.backend.sync())

    @invariant()
    def everything_listed_matches_model(self) -> None:
        listed = self.do(self.backend.list())
        assert [(i.key, i.size) for i in listed] == sorted((k, len(v)) for k, v in self.model.items())


def machine_for(suite: ConformanceHarness, tmp_path: Path) -> type[RuleBasedStateMachine]:
    """A state machine class driving backends made by ``suite``, each example on fresh storage."""
    attrs = {"conformance": suite, "storage_root": tmp_path, "examples": itertools.count()}
    return type(f"{type(suite).__name__}StateMachine", (BackendVsDict,), attrs)
