"""Incremental saves (issue #37, docs/incremental.md): what did not change since the base step is not written again.

* :mod:`.reuse` -- which shards are unchanged, and the manifest that references the base's objects;
* :mod:`.plan`, :mod:`.shadow`, :mod:`.compare` -- what the save writes, against the last save's host copies;
* :mod:`.hosts` -- a multi-host incremental save's side.

A referencing save's pins, and what a deleter of a base must keep for them, are the store's
(:mod:`ckptio.store.pins`).

The manifest's side (format 9: ``bases`` and ``digests``) is :mod:`ckptio.manifest.refs`.
"""
