"""Who writes a save's objects: the :class:`~ckptio.saving.writers.base.Writer` protocol and the
in-process writer (:mod:`.base`), the writer process per host (:mod:`.sidecar`, its child
:mod:`.sidecar_child`, the shared memory it reads (:mod:`.shm`, :mod:`.sidecar_export`) or the
trainer's memory it reads directly (:mod:`.remoteread`)), and the default choice (:mod:`.auto`).
"""
