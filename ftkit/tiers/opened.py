"""Opening a Checkpointer's tiers: one backend each (tiers/backend.py), the RAM tier
bound to its run with its peer group, and the store-key ledger of each tier's commits."""

from __future__ import annotations

import logging
import os
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
from ftkit.errors import ConfigError, FormatError
from ftkit.tiers.backend import NodeRamTier, SharedTier, TierBackend
from ftkit.tiers.peers import PeerGroup
from ftkit.tiers.ram import (
    RunHold,
    RunIdentity,
    SparePool,
    hold_run,
    named_run,
    open_node_dir,
    retire_earlier_lives,
    run_identity,
    run_tokens,
)
from ftkit.tiers.redact import redact_url
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")


@dataclass
class OpenedTiers:
    backends: list[TierBackend]  # per tier, in the Checkpointer's order
    ram_identity: RunIdentity | None  # the run the RAM tier belongs to (tiers/ram.py)
    keys: dict[int, KeyLedger]  # per tier: the store keys its commits left, for a later one to delete
    ram_hold: RunHold | None = None  # this process's hold on the RAM tier: `ftkit gc ram` refuses it meanwhile

    @property
    def ram_news(self) -> CommitNews | None:
        """The RAM tier's commit news, for the watchdog to feed (coord/news.py); None without one."""
        return next((b.news for b in self.backends if isinstance(b, NodeRamTier)), None)


def open_tiers(tiers: Sequence[Tier], ctx: DistContext, run_id: str | None, peer_timeout_s: float) -> OpenedTiers:
    """Open every tier (a bad URL or a missing backend fails here, at start).
    `tiers`: resolved (config.resolve_tiers), so replication is the RAM tier's `replicas`."""
    durable = [t for t in tiers if not t.is_ram]
    storages = _open_durable(tiers)
    ram_identity = None
    if any(t.is_ram for t in tiers):
        ram_identity = run_identity([t.url for t in durable], run_id, _tokens(durable, ctx, run_id))
    backends: list[TierBackend] = []
    ram_hold = None
    for i, t in enumerate(tiers):
        if not t.is_ram:
            backends.append(SharedTier(t, storages[i], NodeGroup.of(ctx, _commit_board(ctx, i))))
            continue
        assert ram_identity is not None
        replicas = t.copies_elsewhere
        ram_hold = hold_run(ram_identity)  # (first: no `ftkit gc ram` removes what is opened next)
        storage = Storage(open_node_dir(ram_identity, ctx.node), private=True)
        if ctx.node_leader(ctx.rank):
            retire_earlier_lives(ram_identity)
        # Room for one step of this node's data files and the replicas it keeps.
        storage.spares = SparePool(storage.root, ctx.nodes.count(ctx.node) * (1 + replicas))
        several_nodes = len(set(ctx.nodes)) > 1
        peers = PeerGroup(ctx.rank, peer_timeout_s) if replicas and several_nodes else None
        if replicas and not several_nodes:
            log.warning("RAM tier replicas: all ranks are on one node (%s); no replica can survive its loss", ctx.node)
        log.info("ftkit: RAM tier of run %s (from %s) at %s", ram_identity.name, ram_identity.source, storage.root)
        group = NodeGroup.of(ctx, _commit_board(ctx, i), RAM, replicas if peers is not None else 0)
        backends.append(NodeRamTier(t, storage, replicas, peers, group))
    keys = {i: b.new_ledger(ctx) for i, b in enumerate(backends)}
    return OpenedTiers(backends, ram_identity, keys, ram_hold)


def _open_durable(tiers: Sequence[Tier]) -> dict[int, Storage]:
    """The storage of each durable tier, by index. Two in one place (the same directory however
    spelled, the same URL on the same filesystem) are a ConfigError: each would commit the other's
    steps and delete by its own `keep` the steps the other keeps."""
    opened: dict[int, Storage] = {}
    seen: dict[tuple[int, str], int] = {}
    for i, t in enumerate(tiers):
        if t.is_ram:
            continue
        storage = opened[i] = t.open()
        place = (id(storage.fs), os.path.realpath(storage.root) if storage.is_local else storage.root.rstrip("/"))
        if place in seen:
            j = seen[place]
            raise ConfigError(
                f"tiers {redact_url(tiers[j].url)!r} and {redact_url(t.url)!r} are the same location "
                f"{storage.display_url}: each tier's retention would delete the other's steps; use one "
                "tier there (keep_every keeps milestones)"
            )
        seen[place] = i
    return opened


def _tokens(durable: Sequence[Tier], ctx: DistContext, run_id: str | None) -> list[str]:
    """The durable tiers' tokens (ram.run_tokens), where they name the RAM tier's run: read
    or made by rank 0, the others get them through the store."""
    if run_id is not None or named_run() is not None or not durable:
        return []  # (as run_tokens: every rank knows it, so none waits for the store key)
    if ctx.rank == 0:
        found = run_tokens(durable)
        if not ctx.distributed:
            return found
        ctx.put("ram/tokens", found)
    got = ctx.get("ram/tokens")
    if not (isinstance(got, list) and all(isinstance(t, str) for t in got)):
        raise FormatError(f"store key ram/tokens holds {str(got)[:80]!r}, not the durable tiers' tokens")
    return got


def _commit_board(ctx: DistContext, tier: int) -> NodeBoard | None:
    """The board this node's ranks post their commit reports for tier `tier` to; its directory is
    this run instance's (a nonce agreed through the store), so a rerun never reads an old report."""
    if not ctx.distributed:
        return None
    instance = ctx.store.compare_set(f"commit/{tier}/board", "", uuid.uuid4().hex).decode()
    board = NodeBoard(f"{ctx.scope}commit/{tier}", ctx.node, ctx.node_leader(ctx.rank), instance, kind="commit")
    board.mailbox(ctx.rank)  # bound now, before the node's ranks send it anything (coord/mailbox.py)
    return board
