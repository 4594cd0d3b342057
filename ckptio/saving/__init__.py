"""A save, from a state to a committed manifest.

:mod:`.job` runs it (stage, write, record, commit: :class:`~ckptio.saving.job.SaveJob`) with
the options and handle of :mod:`.handle`; :mod:`.staging` copies leaves into host buffers the
save owns (:mod:`.fillers` and :mod:`.summedfill` fill and checksum them off the step's path);
:mod:`.writers` says who writes the objects (this process, or a writer process per host);
:mod:`.incremental` writes only what changed; :mod:`.stream` writes a checkpoint array by array
(converters); :mod:`.savestate` names the states of a save.
"""
