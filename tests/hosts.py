"""Several hosts of one job as threads of this process (lives in ckptio.bench.threadhosts)."""

from ckptio.bench.threadhosts import _ThreadGroup, on_hosts

__all__ = ["_ThreadGroup", "on_hosts"]  # _ThreadGroup: tests/paused_save_worker.py builds its own group
