"""Moved to :mod:`ckptio._system.bytes`: this name stays for callers not yet moved (import the new home)."""

from ckptio._system.bytes import *  # noqa: F401,F403
from ckptio._system.bytes import __all__  # noqa: F401
