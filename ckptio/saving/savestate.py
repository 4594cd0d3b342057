"""The states of a save, named once and used everywhere (code, logs, metrics, docs).

* ``staged``: every shard this host owns is in host memory the save owns;
  the training step may go on and mutate its arrays.
* ``written``: every object of this host is durable in storage.
* ``committed``: the coordinator wrote the manifest; the checkpoint exists.
* ``failed``: it never will be committed; storage may hold garbage that the
  orphan sweep collects, and earlier checkpoints are untouched.
"""

from __future__ import annotations

import enum

__all__ = ["SaveState"]


class SaveState(str, enum.Enum):
    STAGED = "staged"
    WRITTEN = "written"
    COMMITTED = "committed"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value
