"""Every tier behind one interface: how a step is committed to it, and who retains, drops or
retires its steps. :class:`SharedTier`: an fsspec URL every rank reaches (commit/shared.py),
owned by rank 0. :class:`NodeRamTier`: the node's shared memory (tiers/ram.py), a cache of this
run each node commits (commit/ram.py, replicas: tiers/peers.py), owned by the node's leader.

Order of calls::

    backends = open_tiers(tiers, ...)            # tiers/opened.py, at Checkpointer start
    backend.persist(job, ctx, key, ledger)       # every rank, each due snapshot (save/pipeline.py)
    backend.retain(ctx, job)                     # by its owner, after its persist succeeded
    backend.committed_steps() / inventory()      # restore planning (ftkit/restore)
    backend.supersede(step)                      # by its owner, the first snapshot after a restore
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from ftkit.commit.keys import KeyLedger
from ftkit.commit.manifests import Committed
from ftkit.commit.node import NodeGroup
from ftkit.commit.ram import persist_node_local, report_skipped_node_local
from ftkit.commit.shared import persist, report_skipped_shared
from ftkit.coord.news import UNHEARD_LIMIT, CommitNews, Settled, publish
from ftkit.format.index import is_part_file
from ftkit.format.manifest import RETIRED_MANIFEST, step_dir_name
from ftkit.format.reader import committed_steps, scan
from ftkit.tiers.lifecycle import delete_step, retire_step
from ftkit.tiers.retention import apply_heard_retention, apply_job_retention

log = logging.getLogger("ftkit")

if TYPE_CHECKING:
    from ftkit.config import Tier
    from ftkit.coord.dist import DistContext
    from ftkit.tiers.peers import PeerGroup
    from ftkit.tiers.storage import Storage


class TierBackend(ABC):
    """One tier: its configuration, its storage, and its protocols."""

    node_local: bool  # every node holds its own copy (True) or every rank sees the same bytes
    superseded_verb: str  # what supersede() does to a step, for messages
    peers: PeerGroup | None = None  # the group a node-local tier moves files between nodes over
    unusable: frozenset[int] = frozenset()  # steps this run's restore found unusable here (retire_superseded)

    @property
    def can_fetch(self) -> bool:
        """Whether a restore can fetch files this node lacks from other nodes (a working peer group)."""
        return self.peers is not None and not self.peers.broken

    def __init__(self, tier: Tier, storage: Storage, group: NodeGroup):
        self.tier, self.storage = tier, storage
        self.group = group  # this rank's node in the commit plan, and its board

    @property
    def display_url(self) -> str:
        return self.storage.display_url

    @abstractmethod
    def owns(self, ctx: DistContext) -> bool:
        """Whether this rank retains, drops and retires steps on this tier (for its node or everyone)."""

    @abstractmethod
    def new_ledger(self, ctx: DistContext) -> KeyLedger:
        """The ledger of the store keys this rank's commits leave (commit/keys.py)."""

    @abstractmethod
    def persist(self, job: Any, ctx: DistContext, key: str, ledger: KeyLedger) -> Committed | None:
        """Every rank: write its share of `job` and take part in the commit; what the committing rank committed."""

    @abstractmethod
    def report_skipped(self, ctx: DistContext, key: str, at: tuple[int, int], reason: str) -> None:
        """Policy "skip": tell whoever waits for this rank in the commit of `key` (training thread)."""

    @abstractmethod
    def supersede(self, step: int) -> None:
        """Take a step newer than a restored one out of the timeline (restore/__init__.py)."""

    def _commit_args(self, job: Any, ctx: DistContext, key: str, ledger: KeyLedger) -> dict[str, Any]:
        """What both commit protocols take from a persist job, beside the storage and the slot."""
        return dict(
            group=self.group,
            compress=self.tier.compress,
            pieces=job.pieces,
            rank_state=job.rank_state,
            ctx=ctx,
            key=key,
            ledger=ledger,
            at=(job.epoch, job.step),
        )

    def persist_details(self) -> dict[str, Any]:
        """What the last persist() of this rank did besides writing, for its "persist" event."""
        return {}

    def committed_steps(self) -> list[int]:
        return committed_steps(self.storage)

    def apply_retention(self, protect: int) -> list[int]:
        """Delete the committed steps the tier's keep/keep_every no longer keep; return them."""
        tier = self.tier
        return apply_job_retention(self.storage, tier.keep, tier.keep_every, protect=protect, failed=self.unusable)

    def retain(self, ctx: DistContext, job: Any) -> list[int]:
        """Retention after this rank's persist of `job` succeeded (its owner calls it); the steps removed."""
        return self.apply_retention(protect=job.step)

    def inventory(self) -> dict[int, tuple[list[str], bool]]:
        """{step: (data files and manifest parts held, committed)} of what this process sees on the tier."""
        out = {}
        for d in scan(self.storage):
            names = [n for n, kind in self.storage.list_dir(step_dir_name(d.step)) if kind == "file"]
            out[d.step] = ([n for n in names if n.endswith(".data") or is_part_file(n)], d.committed)
        return out


class SharedTier(TierBackend):
    node_local = False
    superseded_verb = f"retired (renamed to {RETIRED_MANIFEST})"

    def owns(self, ctx: DistContext) -> bool:
        return ctx.rank == 0

    def new_ledger(self, ctx: DistContext) -> KeyLedger:
        return KeyLedger.shared()

    def persist(self, job: Any, ctx: DistContext, key: str, ledger: KeyLedger) -> Committed | None:
        args = self._commit_args(job, ctx, key, ledger)
        return persist(self.storage, job.step, job.slot, job.skeleton, **args)

    def report_skipped(self, ctx: DistContext, key: str, at: tuple[int, int], reason: str) -> None:
        report_skipped_shared(ctx, self.group, key, at, reason)

    def supersede(self, step: int) -> None:
        retire_step(self.storage, step)  # the manifest renamed aside; the bytes stay until retention


class NodeRamTier(TierBackend):
    node_local = True
    superseded_verb = "dropped"

    def __init__(self, tier: Tier, storage: Storage, replicas: int, peers: PeerGroup | None, group: NodeGroup):
        super().__init__(tier, storage, group)
        self.replicas = replicas  # copies of each rank's data on other nodes
        self.peers = peers  # the gloo group replicas travel over (None: one process)
        self.last_cpu: dict[str, float] = {}  # the last persist's CPU split (persist_details)
        self.news = CommitNews()  # rank 0's word on which steps it keeps (the watchdog feeds it)

    def owns(self, ctx: DistContext) -> bool:
        return ctx.rank == self.group.leader

    def new_ledger(self, ctx: DistContext) -> KeyLedger:
        return KeyLedger.node_local(list(self.group.members), self.group.plan.exchanges)

    def persist(self, job: Any, ctx: DistContext, key: str, ledger: KeyLedger) -> Committed | None:
        if self.peers is not None:
            self.peers.last_run = None
        self.last_cpu = {}
        args = self._commit_args(job, ctx, key, ledger)
        try:
            return persist_node_local(
                self.storage, job.step, job.slot, job.skeleton, peers=self.peers, cpu=self.last_cpu, **args
            )
        except Exception:
            if ctx.rank == 0 and ctx.distributed:  # the step is settled: not committed
                self._tell(ctx, job)
            raise

    def retain(self, ctx: DistContext, job: Any) -> list[int]:
        """A node holding the index follows it and rank 0 publishes what it keeps (coord/news.py);
        another drops what that news settles, and asks for news past UNHEARD_LIMIT unheard steps."""
        if self.group.plan.holds_index(ctx.node):
            removed = self.apply_retention(protect=job.step)
            if ctx.rank == 0 and ctx.distributed:
                self._tell(ctx, job)
            return removed
        removed, unheard = self._apply_news(job.epoch)
        if unheard > UNHEARD_LIMIT:  # snapshots outpace heartbeats: one request, not RAM without bound
            self.news.ask(ctx.store)
            removed += self._apply_news(job.epoch)[0]
        return removed

    def _apply_news(self, epoch: int) -> tuple[list[int], int]:
        news = self.news.of_epoch(epoch)
        return apply_heard_retention(self.storage, news.settled if news else None, news.kept if news else frozenset())

    def _tell(self, ctx: DistContext, job: Any) -> None:
        """Rank 0: every step up to `job.step` is decided; these are the committed ones it keeps."""
        try:
            publish(ctx.store, Settled(job.epoch, job.step, frozenset(self.committed_steps())))
        except Exception as e:  # the others keep what they have: no loss, only RAM held longer
            log.warning("ftkit: could not publish the RAM tier's commit news of step %d: %s", job.step, e)

    def report_skipped(self, ctx: DistContext, key: str, at: tuple[int, int], reason: str) -> None:
        report_skipped_node_local(ctx, self.group, key, at, reason, self.group.plan.exchanges)

    def persist_details(self) -> dict[str, Any]:
        run = self.peers.last_run if self.peers is not None else None
        # This thread's CPU seconds writing the data file and moving replicas.
        cpu = {f"{k}_cpu_s": v for k, v in self.last_cpu.items()}
        return {**cpu, **({"replicate": run} if run else {})}

    def supersede(self, step: int) -> None:
        delete_step(self.storage, step)  # this run's cache: nothing to keep
