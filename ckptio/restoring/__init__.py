"""Restore: manifest -> plan (target regions -> overlapping byte ranges) -> execute (verified reads) -> leaves.

The package, one concern a module, imports pointing down:

* :mod:`.reshard` + :mod:`.reshard_reads`: overlap arithmetic between saved and target slices,
  and the read requests it makes
* :mod:`.from_state`: :func:`~ckptio.restoring.from_state.restore_target`, targets from a live state
* :mod:`.buffers`: destination buffers and the shape/dtype checks of a target
* :mod:`.scalars`: Python scalar targets ("this value, as this type")
* :mod:`.targets`: every target kind (numpy, Sharded, jax, torch, PRNG keys):
  its regions and how its leaf is built
* :mod:`.packed`: bulk reads of many small whole arrays and pack tables
* :mod:`.planner`: :func:`plan` ``(manifest, target) -> ReadPlan``, pure
* :mod:`.executor`: :func:`execute` ``(plan, engine)``, the IO and checksums;
  :func:`restore_checkpoint` = prepare + execute
* :mod:`.batches`: a format-2 restore whose fragments' metadata exceeds a budget, planned,
  read and dropped batch of fragments by batch
* :mod:`.step`: :func:`restore_step`, picking the step (and falling back)
* :mod:`.boxroute` + :mod:`.boxexchange`: read-once restores (``read_once=True``), the
  logical-box exchange: each host reads the fragments it is responsible for and sends others
  the boxes they restore; arrays no two hosts share (:func:`.boxroute.apart`) each host reads itself
  (the DCP Reader's ``read_once`` too: :mod:`ckptio.dcp._readonce`)
* :mod:`.agreement`: the status rounds of a collective restore (a failure on any host raised
  on every host)
"""

from __future__ import annotations

from ckptio.restoring.executor import execute, prepare, restore_checkpoint
from ckptio.restoring.planner import ReadPlan, Selection, plan, select
from ckptio.restoring.scalars import PY_SCALARS
from ckptio.restoring.step import restore_step
from ckptio.restoring.targets import is_target_leaf

# The names ckptio.targets knew this module by.
_PY_SCALARS = PY_SCALARS
_is_target_leaf = is_target_leaf

__all__ = ["ReadPlan", "Selection", "execute", "plan", "prepare", "restore_checkpoint", "restore_step", "select"]
