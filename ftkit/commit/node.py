"""A rank's node as a commit sees it: the world's commit plan (commit/plan.py) and the node's
board (coord/nodelocal.py) that the node's messages go over. Computed once, at start, per tier."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from ftkit.commit.layouts import Published
from ftkit.commit.memo import CommitMemo
from ftkit.commit.plan import SHARED, CommitPlan, NodeRoles
from ftkit.coord.dist import DistContext
from ftkit.coord.nodelocal import NodeBoard, step_message

MAX_REPORT_BYTES = 256 * 2**20  # one rank's tensor entries: megabytes at most


@dataclass(frozen=True)
class NodeGroup:
    """This rank's node in the plan of its world, and its board."""

    board: NodeBoard | None  # where the node's ranks post their messages (None: a world of one)
    plan: CommitPlan
    node: str
    published: Published = field(default_factory=Published, compare=False)  # the RAM tier's layouts in the store
    memo: CommitMemo = field(default_factory=CommitMemo, compare=False)  # what this tier's commit keeps between steps

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
        """Every node's ranks, by leader (rank 0 checks records against it)."""
        return self.plan.members

    @functools.cached_property
    def record_ids(self) -> tuple[int, ...]:
        """The nodes (by leader) whose record rank 0 awaits from the store."""
        return tuple(self.plan.roles_of(c).leader for c in self.plan.record_senders)

    def node_board(self) -> NodeBoard:
        """The node's board, which every commit of a world of several ranks posts through."""
        assert self.board is not None, "a node of several ranks commits through its board"
        return self.board

    def send(
        self,
        at: tuple[int, int],
        what: str,
        me: int,
        message: str | bytes,
        to: tuple[int, ...],
        patient: bool = True,
    ) -> None:
        """Post this rank's message `what` of the step at `at` to the ranks `to` of its node.
        `patient` False: from the training thread, which never waits for room in a mailbox
        (NodeBoard.send)."""
        name = step_message(at, f"{what}-r{me}")
        data = message.encode() if isinstance(message, str) else message
        self.node_board().send(name, data, to, patient)

    def send_named(self, name: str, data: bytes, to: tuple[int, ...], patient: bool = True) -> None:
        """Post `data` as `name` to the ranks `to` (a collector's word to its node)."""
        self.node_board().send(name, data, to, patient)

    def collect(
        self, at: tuple[int, int], what: str, me: int, senders: tuple[int, ...], timeout_s: float
    ) -> dict[int, bytes | None]:
        """Wait for message `what` of the step at `at` from each of `senders` (None: none came
        within `timeout_s`), then remove them and whatever an earlier step left that nobody
        collected (a step this rank skipped)."""
        names = {r: step_message(at, f"{what}-r{r}") for r in senders}
        if not names:
            return {}
        board = self.node_board()
        got = board.collect(names, timeout_s, MAX_REPORT_BYTES, me=me, only_reader=True)
        board.prune_before(at)
        return got
