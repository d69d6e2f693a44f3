"""A rank's node as a commit sees it (`NodeGroup`: the world's plan and the node's board,
once per tier), and `StepExecutor`, what both tiers' executors share."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, ParamSpec

from ftkit.commit.layouts import Published, board_name, from_board, layout_of, lookup
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Report
from ftkit.commit.plan import SHARED, Act, CommitPlan, Msg, NodeRoles, Step
from ftkit.commit.reports import RankReport, decode_report, failed
from ftkit.coord.dist import DistContext
from ftkit.coord.nodelocal import NodeBoard, step_message

if TYPE_CHECKING:
    from ftkit.commit.keys import KeyLedger
    from ftkit.commit.manifests import Committed
    from ftkit.save.sharding import Piece
    from ftkit.save.staging import Slot
    from ftkit.save.write import RankWrite
    from ftkit.tiers.storage import Storage

MAX_REPORT_BYTES = 256 * 2**20  # one rank's tensor entries: megabytes at most
P = ParamSpec("P")


@dataclass(frozen=True)
class NodeGroup:
    """This rank's node in the plan of its world, and its board."""

    board: NodeBoard | None  # where the node's ranks post their messages (None: a world of one)
    plan: CommitPlan
    node: str
    published: Published = field(default_factory=Published, compare=False)  # layouts set in the store
    memo: CommitMemo = field(default_factory=CommitMemo, compare=False)

    @staticmethod
    def of(ctx: DistContext, board: NodeBoard | None, tier: str = SHARED, replicas: int = 0) -> NodeGroup:
        return NodeGroup(board, CommitPlan.of(ctx.nodes, tier, replicas), ctx.node)

    @functools.cached_property
    def roles(self) -> NodeRoles:
        return self.plan.roles(self.node)

    @property
    def ranks(self) -> tuple[int, ...]:
        """This node's ranks; the first is its leader, its name in store keys."""
        return self.roles.ranks

    @property
    def leader(self) -> int:
        return self.roles.leader

    @property
    def collector(self) -> int:
        return self.roles.collector

    @property
    def exchanger(self) -> int:
        return self.roles.exchanger

    @property
    def members(self) -> Mapping[int, tuple[int, ...]]:
        return self.plan.members

    @functools.cached_property
    def record_ids(self) -> tuple[int, ...]:
        """The nodes (by leader) whose record rank 0 awaits from the store."""
        return tuple(self.plan.roles_of(c).leader for c in self.plan.record_senders)

    def node_board(self) -> NodeBoard:
        """The node's board (every world of several ranks has one)."""
        assert self.board is not None, "a node of several ranks commits through its board"
        return self.board

    def send(
        self, at: tuple[int, int], what: str, me: int, data: bytes, to: tuple[int, ...], patience_s: float
    ) -> None:
        """Post message `what` of the step at `at` to the ranks `to`, waiting for room up to
        `patience_s` (0: never wait, the training thread's)."""
        self.node_board().send(step_message(at, f"{what}-r{me}"), data, to, patience_s)


@dataclass(eq=False)
class StepExecutor:
    """One rank's commit of one step: its steps of the plan, run in order by `run`, one
    handler per kind of step (a subclass's HANDLERS). On rank 0 a failure calls
    `not_committed` before it is raised; `record_keys` are deleted whatever happens; this
    rank's own write error is raised at the end (rank 0's has already failed its commit)."""

    HANDLERS: ClassVar[dict[tuple[Act, Msg | None], Callable[[Any, Step], None]]] = {}

    def __init_subclass__(cls) -> None:
        """A subclass's HANDLERS: its methods named after the step they run ("await_report", "part")."""
        cls.HANDLERS = {}
        for act in Act:
            for msg in (None, *Msg):
                handler = getattr(cls, act.value.replace("-", "_") + (f"_{msg.value}" if msg else ""), None)
                if handler is not None:
                    cls.HANDLERS[act, msg] = handler

    storage: Storage
    step: int
    slot: Slot
    skeleton: dict[str, Any]
    _: KW_ONLY
    compress: str | None
    ctx: DistContext
    key: str  # the step's store keys (commit/keys.py commit_key)
    group: NodeGroup
    pieces: Mapping[str, Piece] | None = None
    rank_state: dict[str, Any] | None = None
    ledger: KeyLedger | None = None  # rank 0's: keys of earlier steps, deleted once this step's records are all in
    at: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        self.plan = self.group.plan
        self.error: Exception | None = None  # this rank's write's, raised at the end
        self.record_keys: list[str] = []  # rank 0's: the step's keys it deletes
        self.committed: Committed | None = None
        self.own: RankReport | None = None  # this rank's report of its write
        self.text = b""  # that report, as sent
        self.texts: dict[int, bytes] = {}  # a collector's: its node's reports, as sent

    def run(self) -> Committed | None:
        with contextlib.ExitStack() as self.stack:
            try:
                for step in self.plan.steps(self.ctx.rank):
                    self.do(step)
            except BaseException:
                if self.ctx.rank == 0:
                    self.not_committed()
                raise
            finally:
                if self.record_keys:
                    self.ctx.delete(*self.record_keys)
        if self.ctx.rank != 0 and self.error is not None:
            raise self.error
        return self.committed

    def do(self, step: Step) -> None:
        self.HANDLERS[step.act, step.msg](self, step)

    def report_write(self, write: RankWrite | None) -> None:
        """This rank's report of its write (None: its error)."""
        if write is not None:
            layout, report = layout_of(write, self.group.memo, self.rank_state)
            self.own = RankReport(self.ctx.rank, report, layout)
        else:
            self.own = failed(self.ctx.rank, str(self.error))
        self.text = self.own.report.encode()

    def await_report(self, step: Step) -> None:
        lost = Report.failed(f"no report within {self.ctx.timeout_s:.0f}s").encode()
        self.texts = {r: raw or lost for r, raw in self.collect("w", step.peers).items()}

    def node_reports(self) -> list[RankReport]:
        """A collector's: its node's reports in rank order, their layouts found (its own not parsed
        back, and added to `texts`, which its node's exchange carries)."""
        ctx, memo = self.ctx, self.group.memo
        assert self.own is not None
        memo.decoded.put((ctx.rank, self.text), self.own)
        self.texts = {ctx.rank: self.text, **self.texts}
        layouts = lookup(from_board(self.group.board, ctx.rank), memo)
        return [decode_report(r, self.texts[r], layouts, memo) for r in self.group.ranks]

    def collect(self, what: str, senders: tuple[int, ...]) -> dict[int, bytes | None]:
        """Wait for message `what` of this step from each of `senders` (None: none came in time),
        then remove them and what earlier steps left uncollected (a skipped step's)."""
        names = {r: step_message(self.at, f"{what}-r{r}") for r in senders}
        if not names:
            return {}
        board, ctx = self.group.node_board(), self.ctx
        got = board.collect(names, ctx.timeout_s, MAX_REPORT_BYTES, ctx.rank, serves=ctx.generation)
        board.prune_before(self.at)
        return got

    def send_report(self, step: Step) -> None:
        """SEND report: its layout (once per connection to the collector), then the report."""
        assert self.own is not None
        if self.own.layout is not None:
            layout = self.own.layout
            body, patience = layout.body.encode(), self.ctx.timeout_s  # (as long as the collector may take)
            self.group.node_board().send_once(board_name(layout.digest), body, step.peers, patience)
        self.group.send(self.at, "w", self.ctx.rank, self.text, step.peers, self.ctx.timeout_s)

    def not_committed(self) -> None:
        """Rank 0's failure: remove what the step put where rank 0 can remove it."""


def runner(executor: Callable[P, StepExecutor]) -> Callable[P, Committed | None]:
    """A function that runs one step's commit with `executor`: what was committed on rank 0, None elsewhere."""

    def run(*args: P.args, **kwargs: P.kwargs) -> Committed | None:
        return executor(*args, **kwargs).run()

    return run
