"""Coordination across hosts, borrowed from the framework that is already running.

The coordinators (:mod:`.distributed`: one process, ``torch.distributed`` in :mod:`.torchcoord`,
``jax.distributed``), the byte exchanges on their collectives (:mod:`.exchange`), deadlines on
every collective wait (:mod:`.waits`, bounded for torch by :mod:`.storegate` and for jax by
:mod:`.kvwaits`), a save's one collective verdict (:mod:`.collective`) and the agreement on a
step to save at after a preemption notice (:mod:`.preemption`).
"""
