"""The ``ckptio`` command's parts (the entry point and parser are :mod:`ckptio.cli`)."""
