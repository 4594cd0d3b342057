"""Managing a root's checkpoints over a run: the :class:`~ckptio.manage.manager.CheckpointManager`
(periodic saves, retention, preemption), which steps are kept (:mod:`.retention`, best-N in
:mod:`.best_n`), copying (:mod:`.copying`), verifying (:mod:`.verify`) and publishing a Hyperdisk
ML volume (:mod:`.hdml_publish`)."""
