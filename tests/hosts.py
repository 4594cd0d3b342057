"""Several hosts of one job as threads of this process (lives in ckptio.bench.threadhosts)."""

from ckptio.bench.threadhosts import on_hosts

__all__ = ["on_hosts"]
