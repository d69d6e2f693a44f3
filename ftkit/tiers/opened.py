"""Opening a Checkpointer's tiers: one backend each (tiers/backend.py), the RAM tier
bound to its run with its peer group, and the store-key ledger of each tier's commits."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ftkit.commit.keys import KeyLedger
from ftkit.commit.node import NodeGroup
from ftkit.commit.plan import RAM
from ftkit.config import Tier
from ftkit.coord.dist import DistContext
from ftkit.coord.news import CommitNews
from ftkit.coord.nodelocal import NodeBoard
from ftkit.tiers.backend import NodeRamTier, SharedTier, TierBackend
from ftkit.tiers.peers import PeerGroup
from ftkit.tiers.ram import RunIdentity, SparePool, open_node_dir, run_identity
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")


@dataclass
class OpenedTiers:
    backends: list[TierBackend]  # per tier, in the Checkpointer's order
    ram_identity: RunIdentity | None  # the run the RAM tier belongs to (tiers/ram.py)
    keys: dict[int, KeyLedger]  # per tier: the store keys its commits left, for a later one to delete

    @property
    def ram_news(self) -> CommitNews | None:
        """The RAM tier's commit news, for the watchdog to feed (coord/news.py); None without one."""
        return next((b.news for b in self.backends if isinstance(b, NodeRamTier)), None)


def open_tiers(tiers: Sequence[Tier], ctx: DistContext, run_id: str | None, peer_timeout_s: float) -> OpenedTiers:
    """Open every tier (a bad URL or a missing backend fails here, at start).
    `tiers`: resolved (config.resolve_tiers), so replication is the RAM tier's `replicas`."""
    durable = [t.url for t in tiers if not t.is_ram]
    ram_identity = run_identity(durable, run_id) if any(t.is_ram for t in tiers) else None
    backends: list[TierBackend] = []
    for i, t in enumerate(tiers):
        if not t.is_ram:
            backends.append(SharedTier(t, t.open(), NodeGroup.of(ctx, _commit_board(ctx, i))))
            continue
        assert ram_identity is not None
        replicas = t.copies_elsewhere
        storage = Storage(open_node_dir(ram_identity, ctx.node), private=True)
        # Room for one step of this node's data files and the replicas it keeps.
        storage.spares = SparePool(storage.root, ctx.nodes.count(ctx.node) * (1 + replicas))
        peers = PeerGroup(ctx.rank, peer_timeout_s) if replicas and ctx.distributed else None
        if replicas and len(set(ctx.nodes)) < 2:
            log.warning("RAM tier replicas: all ranks are on one node (%s); no replica can survive its loss", ctx.node)
        log.info("ftkit: RAM tier of run %s (from %s) at %s", ram_identity.name, ram_identity.source, storage.root)
        group = NodeGroup.of(ctx, _commit_board(ctx, i), RAM, replicas if peers is not None else 0)
        backends.append(NodeRamTier(t, storage, replicas, peers, group))
    keys = {i: b.new_ledger(ctx) for i, b in enumerate(backends)}
    return OpenedTiers(backends, ram_identity, keys)


def _commit_board(ctx: DistContext, tier: int) -> NodeBoard | None:
    """The board this node's ranks post their commit reports for tier `tier` to; its directory is
    this run instance's (a nonce agreed through the store), so a rerun never reads an old report."""
    if not ctx.distributed:
        return None
    instance = ctx.store.compare_set(f"commit/{tier}/board", "", uuid.uuid4().hex).decode()
    board = NodeBoard(f"{ctx.scope}commit/{tier}", ctx.node, ctx.node_leader(ctx.rank), instance, kind="commit")
    board.mailbox(ctx.rank)  # bound now, before the node's ranks send it anything (coord/mailbox.py)
    return board
