"""What a restore needs from the Checkpointer: a small explicit context, so the
restore code never reaches into the Checkpointer's private fields."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.config import Tier
from ftkit.coord.dist import DistContext


@dataclass
class RestoreContext:
    state: MutableMapping[str, Any]  # the live state, loaded in place
    rng: bool  # restore this rank's RNG state too
    dist: DistContext  # rank, nodes, and the store the ranks agree through
    tiers: Sequence[Tier]
    storages: Sequence[Any]  # per tier: a Storage, or None for the "peer" tier
    ram: int | None  # index of the "ram" tier
    peers: Any  # the PeerGroup, or None
    arena: Any  # the StagingArena: device tensors are read through its pinned memory
    emit: Callable[..., None]  # the event log

    @property
    def can_fetch(self) -> bool:
        """Whether files can move between nodes (a working peer group)."""
        return self.peers is not None and not self.peers.broken
