"""Moved to :mod:`ckptio._system.pages`: this name stays for callers not yet moved (import the new home)."""

from ckptio._system.pages import *  # noqa: F401,F403
from ckptio._system.pages import __all__  # noqa: F401
