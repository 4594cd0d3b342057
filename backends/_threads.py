"""Moved to :mod:`ckptio._system.threads`: this name stays for callers not yet moved (import the new home)."""

from ckptio._system.threads import *  # noqa: F401,F403
from ckptio._system.threads import __all__  # noqa: F401
