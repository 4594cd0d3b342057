"""docs/backends.md's "Write a backend" example: every object a row of one SQLite file (``sqlite:///path/db``)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from ckptio.backends.base import (
    Backend, ByteRange, Capabilities, LayoutDefaults, ObjectInfo, check_fill, check_key, check_prefix,
)


class SQLiteBackend(Backend):
    """Objects as rows ``(key, data, mtime)``; each call is one transaction, run in a thread."""

    def __init__(self, url: str) -> None:
        self._url, self._path = url, url.split("://", 1)[1]
        # Declared, not discovered: SQLite commits atomically and its INSERT is a real conditional create.
        self.capabilities = Capabilities(preferred_io_size=1 << 20, concurrency=4)
        self.layout_defaults = LayoutDefaults(object_size=16 << 20)  # how checkpoints are laid out here
        self._sql("CREATE TABLE IF NOT EXISTS objects (key TEXT PRIMARY KEY, data BLOB, mtime REAL)")

    @property
    def url(self) -> str:
        return self._url

    def _sql(self, query: str, *args: Any) -> list[Any]:
        with sqlite3.connect(self._path, timeout=60) as db:  # one connection per call: thread-safe
            return db.execute(query, args).fetchall()

    async def _run(self, query: str, *args: Any) -> list[Any]:
        return await asyncio.to_thread(self._sql, query, *args)

    async def write(self, key: str, buffers: Sequence[memoryview]) -> None:
        data = b"".join(buffers)
        await self._run("INSERT OR REPLACE INTO objects VALUES (?, ?, ?)", check_key(key), data, time.time())

    async def read_into(self, key: str, rng: ByteRange, buffers: Sequence[memoryview]) -> None:
        check_fill(rng, buffers)
        rows = await self._run("SELECT substr(data, ?, ?), length(data) FROM objects WHERE key = ?",
                               rng.start + 1, rng.length, check_key(key))
        if not rows:
            raise FileNotFoundError(f"{self._url}/{key}: no such object")
        data, size = rows[0]
        if rng.end > size:
            raise ValueError(f"{self._url}/{key}: range [{rng.start}, {rng.end}) past end {size}")
        pos = 0
        for b in (b for b in buffers if b.nbytes):  # a view with a zero in its shape cannot be cast
            b.cast("B")[:], pos = data[pos : pos + b.nbytes], pos + b.nbytes  # cast: float arrays too

    async def create_if_absent(self, key: str, data: bytes) -> None:
        try:
            await self._run("INSERT INTO objects VALUES (?, ?, ?)", check_key(key), bytes(data), time.time())
        except sqlite3.IntegrityError:
            raise FileExistsError(f"{self._url}/{key}: object exists") from None

    async def delete(self, key: str) -> None:
        if not await self._run("DELETE FROM objects WHERE key = ? RETURNING key", check_key(key)):
            raise FileNotFoundError(f"{self._url}/{key}: no such object")

    async def stat(self, key: str) -> ObjectInfo:
        for info in await self._infos("key = ?", check_key(key)):
            return info
        raise FileNotFoundError(f"{self._url}/{key}: no such object")

    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        return await self._infos("substr(key, 1, ?) = ? ORDER BY key", len(check_prefix(prefix)), prefix)

    async def _infos(self, where: str, *args: Any) -> list[ObjectInfo]:
        rows = await self._run(f"SELECT key, length(data), mtime FROM objects WHERE {where}", *args)
        return [ObjectInfo(k, n, t) for k, n, t in rows]
