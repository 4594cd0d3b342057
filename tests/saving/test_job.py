"""The save job's parts on their own: the collective verdict, the writer choice, layout options.

A save is :class:`ckptio.saving.job.SaveJob` (stage, write, record, verdict/commit, finish);
these tests pin the contracts its phases rely on, without a whole save where none is
needed: every host joins the gather and the broadcast even when the commit fails
(``collective_verdict``), the writer string maps once to a writer object, and the
tile size is a layout option read in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hosts import on_hosts

import ckptio
from ckptio.backends.base import LayoutDefaults
from ckptio.coord.collective import Verdict, collective_verdict, failed_record, join_as_failed
from ckptio.coord.distributed import SingleProcess
from ckptio.engine import EngineConfig
from ckptio.engine.layout import LayoutOptions
from ckptio.saving.options import SaveOptions
from ckptio.saving.job import SaveJob, start_save
from ckptio.saving.writers.base import ENV, THREAD_WRITER, ThreadWriter, writer_name
from ckptio.saving.writers.sidecar import SIDECAR_WRITER, writer_for
from ckptio.store import CheckpointStore


def test_every_host_gets_the_coordinators_verdict() -> None:
    committed: list[list[dict[str, Any]]] = []
    verdicts = on_hosts(3, lambda rank, coord: collective_verdict(coord, {"ok": True, "rank": rank}, committed.append))
    assert verdicts == [Verdict(True)] * 3
    assert [[r["rank"] for r in records] for records in committed] == [[0, 1, 2]]  # on the coordinator only


def test_a_failed_host_fails_every_host_and_nothing_commits() -> None:
    def host(rank: int, coord: Any) -> Verdict:
        record = failed_record(rank, OSError("disk full")) if rank == 1 else {"ok": True}
        return collective_verdict(coord, record, lambda _records: pytest.fail("committed after a failure"))

    verdicts = on_hosts(3, host)
    assert all(not v.ok and v.error == "host 1: OSError: disk full" for v in verdicts)


def test_a_failed_commit_still_reaches_every_host_then_raises_on_the_coordinator() -> None:
    def refuse(_records: list[dict[str, Any]]) -> None:
        raise FileExistsError("taken")

    def host(rank: int, coord: Any) -> Verdict | str:
        try:
            return collective_verdict(coord, {"ok": True}, refuse)
        except FileExistsError as e:
            return f"raised {e}"

    assert on_hosts(2, host) == ["raised taken", Verdict(False, "commit: FileExistsError: taken")]


def test_a_refusal_joins_the_other_hosts_verdict() -> None:
    def host(rank: int, coord: Any) -> Verdict | None:
        if rank == 0:
            join_as_failed(coord, "host 0: ValueError: bad leaf", "somewhere")
            return None
        return collective_verdict(coord, {"ok": True})

    assert on_hosts(2, host) == [None, Verdict(False, "host 0: ValueError: bad leaf")]


def test_one_host_needs_no_collective_to_refuse() -> None:
    join_as_failed(SingleProcess(), "host 0: ValueError: x", "here")  # returns at once, nothing to join


def test_the_writer_string_maps_once_to_a_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert writer_name(None) == "thread"
    assert SaveOptions(writer="sidecar").writer_name() == "sidecar"
    monkeypatch.setenv(ENV, "sidecar")
    assert SaveOptions().writer_name() == "sidecar"
    assert SaveOptions(writer="thread").writer_name() == "thread"  # the option wins over the environment
    with pytest.raises(ValueError, match="SaveOptions.writer='proc'"):
        SaveOptions(writer="proc")
    monkeypatch.setenv(ENV, "proc")
    with pytest.raises(ValueError, match=f"{ENV}='proc'"):
        SaveOptions().writer_name()
    monkeypatch.delenv(ENV)
    store = CheckpointStore(str(tmp_path))
    assert writer_for(store) is THREAD_WRITER and THREAD_WRITER.name == "thread"
    mem = CheckpointStore("mem://savejob-writer")
    assert SaveOptions(writer="sidecar").writer_for(mem) is THREAD_WRITER  # process-local: the in-process writer
    assert SIDECAR_WRITER.name == "sidecar"


def test_tile_bytes_is_a_layout_option() -> None:
    shared = LayoutDefaults(object_size=4 << 20, tile_bytes=1 << 20)
    assert LayoutOptions().tile_bytes_for(shared) == 1 << 20  # the backend's default
    assert LayoutOptions(tile_bytes=0).tile_bytes_for(shared) == 0
    assert LayoutOptions(tile_bytes=64 << 20).tile_bytes_for(shared) == 4 << 20  # never above one object
    assert SaveOptions(tile_bytes=4096).layout == LayoutOptions(tile_bytes=4096)  # the public spelling, mapped once
    assert EngineConfig.__dataclass_fields__.keys().isdisjoint({"tile_bytes", "writer", "gil_switch_s"})  # not the engine's


class _CountingWriter(ThreadWriter):
    """The thread writer, counting its calls: any Writer object can drive a save."""

    def __init__(self) -> None:
        self.objects = 0

    def write(self, store: CheckpointStore, plans: Any, *args: Any) -> Any:
        self.objects += len(plans)
        return super().write(store, plans, *args)


def test_a_save_job_runs_its_phases_with_the_options_given(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    writer = _CountingWriter()
    state = {"w": np.arange(64.0).reshape(8, 8), "step": 3}
    options = SaveOptions(writer, tile_bytes=0)
    manifest = start_save(store, 3, state, options=options).result()
    assert manifest is not None and writer.objects >= 1
    assert ckptio.restore(str(tmp_path), 3)["w"].tolist() == state["w"].tolist()

    job = SaveJob(store, 4, options=options)
    handle = job.stage({"w": np.ones(3)})
    assert handle.result() is not None and handle is job.handle and job.manifest is not None
    assert job.plans and all(f.done() for f in job.ready)
