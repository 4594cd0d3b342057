"""``ckptio.dcp.PerRank``: a ``Stateful`` whose state is each rank's own (a data loader) under DCP.

DCP saves a ``Stateful``'s ``state_dict()`` under its FQNs, and its planner
keeps one copy of a non-tensor value saved by several ranks under the same
FQN: every rank's data-loader state would collapse into one. ``PerRank``
keys the state by rank (``{"rank_3": state}``, as torchtitan keys
``dataloader.dp_rank_3``), so every rank's own state is saved in the same
commit, and on load each rank asks for, and gets, its own. Loading with
another number of ranks than saved is refused, naming both counts, unless
``on_resize`` is given (as :class:`ckptio.PerHost`'s: ``fn(saved_states,
rank, world) -> state``, which reads the saved ranks' states itself).
"""

from __future__ import annotations

import copy
from typing import Any

from ckptio.state.perhost import OnResize, load_state, state_of

__all__ = ["PerRank"]


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PerRank:
    """Wraps ``obj`` (``state_dict``/``load_state_dict`` or ``get_state``/``set_state``) for
    ``dcp.save`` / ``dcp.load``: ``{"loader": PerRank(loader)}``.

    ``saved_world``: the number of ranks that saved, when it differs from this job's; then
    ``on_resize`` maps the saved states (read as ``rank_0`` .. ``rank_{saved_world-1}``) to this rank.
    """

    def __init__(self, obj: Any, *, saved_world: int | None = None, on_resize: OnResize | None = None) -> None:
        self.obj, self.saved_world, self.on_resize = obj, saved_world, on_resize

    def state_dict(self) -> dict[str, Any]:
        rank, world = _rank_world()
        saved = self.saved_world or world
        if saved == world:
            return {f"rank_{rank}": state_of(self.obj)}
        if self.on_resize is None:
            raise ValueError(f"PerRank: saved by {saved} ranks, loaded by {world}; pass on_resize= to map the saved "
                             "states to ranks (e.g. ckptio.state.perhost.take_modulo)")
        # A load: ask for every saved rank's state, in the shape this rank's own one has; a copy each,
        # as DCP loads into the containers it is given (one shared dict would end up holding the last rank's).
        own = state_of(self.obj)
        return {f"rank_{r}": copy.deepcopy(own) for r in range(saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank, world = _rank_world()
        saved = self.saved_world or world
        if saved == world:
            load_state(self.obj, state[f"rank_{rank}"])
        else:
            assert self.on_resize is not None
            load_state(self.obj, self.on_resize([state[f"rank_{r}"] for r in range(saved)], rank, world))
