"""Opening a Checkpointer's tiers: each one's storage, the RAM tier bound to its run,
its peer replication, and the store-key ledger of each tier's commits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ftkit.config import Tier
from ftkit.coord.dist import DistContext
from ftkit.save.keys import KeyLedger
from ftkit.tiers.peers import PeerGroup
from ftkit.tiers.ram import RunIdentity, SparePool, open_node_dir, run_identity
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")


@dataclass
class OpenedTiers:
    storages: list[Storage | None]  # per tier; None for the "peer" tier (replication is the RAM tier's)
    ram_index: int | None  # the "ram" tier's index
    ram_identity: RunIdentity | None  # the run the RAM tier belongs to (tiers/ram.py)
    replicas: int  # copies of each rank's RAM-tier data on other nodes
    peers: PeerGroup | None  # the dedicated gloo group replicas travel over
    keys: dict[int, KeyLedger]  # per tier: the store keys its commits left, for a later one to delete


def open_tiers(tiers: Sequence[Tier], ctx: DistContext, run_id: str | None, peer_timeout_s: float) -> OpenedTiers:
    """Open every tier (a bad URL or a missing backend fails here, at start)."""
    ram_identity = (
        run_identity([t.url for t in tiers if not (t.is_ram or t.is_peer)], run_id)
        if any(t.is_ram for t in tiers)
        else None
    )
    ram_storage = Storage(open_node_dir(ram_identity, ctx.node)) if ram_identity else None
    storages = [ram_storage if t.is_ram else (None if t.is_peer else t.open()) for t in tiers]
    ram_index = next((i for i, t in enumerate(tiers) if t.is_ram), None)
    peer = next((t for t in tiers if t.is_peer), None)
    if peer and ram_index is None:
        raise ValueError('the "peer" tier replicates the "ram" tier: add "ram" to the tiers')
    replicas = peer.replicas if peer else 0
    if ram_storage is not None:  # room for one step of this node's data files and replicas
        ram_storage.spares = SparePool(ram_storage.root, ctx.nodes.count(ctx.node) * (1 + replicas))
    keys = {
        i: KeyLedger.node_local(ctx.rank) if t.is_ram else KeyLedger.shared(ctx.world_size)
        for i, t in enumerate(tiers)
        if not t.is_peer
    }
    peers = PeerGroup(ctx.rank, ctx.world_size, peer_timeout_s) if peer and ctx.distributed else None
    if peer and len(set(ctx.nodes)) < 2:
        log.warning("peer tier: all ranks are on one node (%s); no replica can survive its loss", ctx.node)
    if ram_identity is not None and ram_storage is not None:
        log.info(
            "ftkit: RAM tier of run %s (from %s) at %s", ram_identity.name, ram_identity.source, ram_storage.display_url
        )
    return OpenedTiers(storages, ram_index, ram_identity, replicas, peers, keys)
