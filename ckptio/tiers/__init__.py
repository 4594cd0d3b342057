"""Multi-tier checkpointing: a fast tier per host, a partner's replica, a durable tier.

>>> mngr = TieredCheckpointManager("/mnt/ssd/run1", "gs://bucket/run1",
...                                policy=TierPolicy(replicate_every=10))
>>> mngr.save(step, state)            # to the fast tier; returns once staged
>>> state = mngr.restore(target=abstract_state)   # newest complete anywhere, fastest source first

* every save goes to each host's fast tier (host RAM ``mem://`` or local SSD);
* each host's latest snapshot is sent to a partner host over a dedicated
  gloo group of ``torch.distributed`` (the in-memory emergency tier);
* every ``replicate_every``-th step is copied to the durable tier in the
  background through a bounded queue and committed there with its own
  manifest (never a checkpoint that is not committed in the fast tier);
* a restore takes the newest checkpoint complete in some tier, and each host
  reads each writer's objects from itself, else a peer, else the durable tier.
"""

from __future__ import annotations

from ckptio.tiers.group import LocalGroup, TorchGroup
from ckptio.tiers.manager import RestoreReport, TieredCheckpointManager
from ckptio.tiers.policy import (
    DURABLE, LOCAL, PEER, TIERS, Holding, RestorePlan, Retention, TierPolicy, plan_restore,
)
from ckptio.tiers.replicator import ReplicationError

__all__ = [
    "DURABLE",
    "LOCAL",
    "PEER",
    "TIERS",
    "Holding",
    "LocalGroup",
    "ReplicationError",
    "RestorePlan",
    "RestoreReport",
    "Retention",
    "TierPolicy",
    "TieredCheckpointManager",
    "TorchGroup",
    "plan_restore",
]
