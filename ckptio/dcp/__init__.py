"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) on ckptio.

>>> import torch.distributed.checkpoint as dcp
>>> from ckptio.dcp import Writer, Reader
>>> dcp.save(state_dict, storage_writer=Writer("gs://bucket/run1", step=100))
>>> dcp.async_save(state_dict, storage_writer=Writer("/mnt/ssd/run1/100"))   # thread or process executor
>>> dcp.load(state_dict, storage_reader=Reader("gs://bucket/run1", step=100))

Every byte goes through the ckptio engine: tensors as raw bytes, chunks
packed into objects named by the store's layout, DCP's Metadata kept as
JSON inside a normal ckptio manifest, committed last. The result is also a
native ckptio checkpoint (``ckptio.restore(url)`` returns ``{fqn: array}``)
and, on a local path, a stock one: each chunk's raw bytes sit inside a
``torch.save`` frame and DCP's ``.metadata`` is written for torch
(:mod:`ckptio.dcp._torchsave`). Importing this module imports torch.
"""

from __future__ import annotations

from ckptio.dcp._codec import ChunkLocation
from ckptio.dcp.perrank import PerRank
from ckptio.dcp.reader import Reader
from ckptio.dcp.stager import DEFAULT_BUFFERS, HostBuffers, Stager, stage_state_dict
from ckptio.dcp.writer import Writer

__all__ = ["DEFAULT_BUFFERS", "ChunkLocation", "HostBuffers", "PerRank", "Reader", "Stager", "Writer", "stage_state_dict"]
