"""Checkpoints under one root URL: where they live, which are committed, deletion, orphan sweep.

A checkpoint of step ``s`` lives in the step directory ``<root>/<s>`` (the
root itself when saved without a step); it exists once
``<step dir>/ckptio.manifest.json`` does, and it is *intact* once that
manifest validates and is bound to its place (it names step ``s``, and every
object it lists lies in step ``s``'s layout).

A save announces itself before its first object with an *intent*
(``<step dir>/ckptio.intent.<save id>``, see :mod:`ckptio.store.intents`) and
keeps it fresh while in flight; whatever deletes (gc, retention, a re-save's
cleanup) spares every object of a live intent, whatever its age, and
deletes only keys that :mod:`ckptio.manifest.names` proves are ckptio's.

Deletion first writes a tombstone (``ckptio.deleting``) so no reader picks a
checkpoint whose objects are going away (:mod:`ckptio.store.deletion`); a
commit is fenced against deleters (:mod:`ckptio.store.fence`).

Layers, each importing only those above it in this list:
:mod:`~ckptio.store.options` (:class:`StoreOptions`, the step vocabulary),
:mod:`~ckptio.store.companions` (files a manifest proves it wrote for other tools) ->
:mod:`~ckptio.store.context` (what the services share; storage calls retried
once, there) -> :mod:`~ckptio.store.manifests`, :mod:`~ckptio.store.objects`,
:mod:`~ckptio.store.intents` -> :mod:`~ckptio.store.catalog`,
:mod:`~ckptio.store.deletion` -> :mod:`~ckptio.store.commit`,
:mod:`~ckptio.store.gc` -> :mod:`~ckptio.store.resave` -> :mod:`~ckptio.store.facade` (:class:`CheckpointStore`).
"""

from __future__ import annotations

from ckptio.store.catalog import StepStatus
from ckptio.store.facade import CheckpointStore
from ckptio.store.gc import SweepReport, sweeps_temporaries_by_prefix
from ckptio.store.manifests import check_binding
from ckptio.store.objects import manifest_object_sizes
from ckptio.store.options import DEFAULT_LEASE_S, MAX_STEP, StoreOptions, check_grace, step_dir_of

__all__ = [
    "CheckpointStore", "DEFAULT_LEASE_S", "MAX_STEP", "StepStatus", "StoreOptions", "SweepReport", "check_binding",
    "check_grace", "manifest_object_sizes", "step_dir_of", "sweeps_temporaries_by_prefix",
]
