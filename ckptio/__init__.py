"""ckptio: a storage layer for sharded ML checkpoints."""
