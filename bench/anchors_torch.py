"""Anchors from the PyTorch side: DCP (sync and async) and ``torch.save``.

All three get torch tensors that share the numpy state's memory (no copy at
setup). Restores allocate fresh tensors inside the timing, as a training
job resuming from scratch would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptio.bench.cases import Case, Pending, register

__all__ = ["DCPAsyncSave", "DCPSave", "TorchSave"]


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DCPBase(Case):
    framework = "torch"
    requires = ("torch",)
    durability = "DCP fsyncs each .distcp file (sync_files=True), renames .metadata; no directory fsync"
    thread_count = 4

    def setup(self) -> None:
        import torch.distributed.checkpoint as dcp

        self._dcp = dcp

    def _writer(self, step: int) -> Any:
        return self._dcp.FileSystemWriter(self.step_path(step) or "", thread_count=self.thread_count)

    def restore(self, step: int) -> Mapping[str, Any]:
        import torch

        target = {k: torch.empty_like(v) for k, v in self.state.items()}
        self._dcp.load(target, storage_reader=self._dcp.FileSystemReader(self.step_path(step) or ""))
        return target


@register
class DCPSave(_DCPBase):
    """``dcp.save`` with ``FileSystemWriter(thread_count=4)``; ``dcp.load`` into fresh tensors."""

    name = "dcp"
    max_world = 64
    sweep_max_tensors = 10_000  # DCP plans per item in Python: 100k items takes minutes
    description = "dcp.save(FileSystemWriter(thread_count=4)); dcp.load into fresh tensors"

    def save(self, step: int) -> Pending | None:
        self._dcp.save(self.state, storage_writer=self._writer(step))
        return None


@register
class DCPAsyncSave(_DCPBase):
    """``dcp.async_save`` (thread executor): the stall is its staging copy, the total is the write."""

    name = "dcp-async"
    description = "dcp.async_save(FileSystemWriter(thread_count=4)), thread executor; dcp.load"
    #: DCP's ``AsyncCheckpointerType`` value: where its background write runs.
    executor = "thread"

    def setup(self) -> None:
        super().setup()
        import torch.distributed as dist

        # async_save needs a (gloo) process group even for one process.
        self._own_pg = not dist.is_initialized()
        if self._own_pg:
            dist.init_process_group(
                "gloo", init_method=f"file://{self.ctx.root}/.pg_store", rank=0, world_size=1
            )

    def save(self, step: int) -> Pending | None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        out = self._dcp.async_save(
            self.state, storage_writer=self._writer(step), async_checkpointer_type=AsyncCheckpointerType(self.executor)
        )
        # Newer torch returns an AsyncSaveResponse when staging is itself async.
        return getattr(out, "upload_completion", out)

    def close(self) -> None:
        import torch.distributed as dist

        if self._own_pg and dist.is_initialized():
            dist.destroy_process_group()


@register
class DCPAsyncProcessSave(DCPAsyncSave):
    """``dcp.async_save`` with DCP's process executor: the write runs in DCP's own background
    process, so none of it shares the training thread's GIL (what ``--train`` measures)."""

    name = "dcp-async-process"
    in_default_run = False
    description = "dcp.async_save(FileSystemWriter(thread_count=4)), process executor; dcp.load"
    executor = "process"

    def setup(self) -> None:
        # DCP's background process rendezvouses over TCP on MASTER_ADDR (the host's name when
        # unset): keep it on loopback.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        super().setup()


@register
class TorchSave(Case):
    """``torch.save`` of the whole state dict into one file, then fsync; ``torch.load``."""

    name = "torch-save"
    framework = "torch"
    requires = ("torch",)
    description = "torch.save to one file + fsync (file and dir); torch.load(weights_only=True)"
    durability = "torch.save does not fsync; the case fsyncs the file and directory itself"

    def _file(self, step: int) -> str:
        return os.path.join(self.step_path(step) or "", "state.pt")

    def save(self, step: int) -> Pending | None:
        import torch

        os.makedirs(self.step_path(step) or "", exist_ok=True)
        with open(self._file(step), "wb") as f:
            torch.save(dict(self.state), f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(self.step_path(step) or "", directory=True)
        return None

    def restore(self, step: int) -> Mapping[str, Any]:
        import torch

        return torch.load(self._file(step), weights_only=True)
