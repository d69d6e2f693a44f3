"""What a restore needs from the Checkpointer, so restore/ never reaches into its private fields."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.tiers.backend import TierBackend


@dataclass
class RestoreContext:
    state: MutableMapping[str, Any]  # the live state, loaded in place
    rng: bool  # restore this rank's RNG state too
    dist: DistContext  # rank, nodes, and the store the ranks agree through
    backends: Sequence[TierBackend]  # per tier (tiers/backend.py)
    arena: Any  # the StagingArena: device tensors are read through its pinned memory
    emit: Callable[..., None]  # the event log

    @property
    def ram(self) -> int | None:
        """The index of the node-local tier (node RAM), if there is one."""
        return next((i for i, b in enumerate(self.backends) if b.node_local), None)
