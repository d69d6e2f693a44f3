"""Peer replication: copies of each rank's RAM-tier data on other nodes.

Placement is the commit plan's (commit/plan.py): rank r's file goes to the ranks at r's
local index on the next k nodes, so one lost node never takes a shard and all its replicas.
Transport: a dedicated gloo group (never the training group), used from ftkit's background
thread and from restore(). Every rank posts all its sends and receives at once, in one
order all ranks agree on, so messages between two ranks match up and nothing deadlocks.
The group's timeout bounds a dead peer's cost; after a transport failure the group stays broken
(a file that cannot be read or stored fails only its run).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from ftkit.commit.plan import RAM, CommitPlan
from ftkit.errors import PeerTransferError, one_line


@dataclass(frozen=True)
class Transfer:
    """Send one data file of a step from one rank to another."""

    src: int
    dst: int
    file: str


def replica_targets(rank: int, nodes: Sequence[str], k: int) -> list[int]:
    """The ranks that hold replicas of `rank`'s data: one per other node, k at most."""
    return CommitPlan.of(nodes, RAM, k).replica_targets(rank)


def replication_plan(files: Sequence[str | None], nodes: Sequence[str], k: int) -> list[Transfer]:
    """Every rank's file to its replica targets, in one order all ranks agree on."""
    plan = CommitPlan.of(nodes, RAM, k)
    targets = [plan.replica_targets(rank) if name is not None else [] for rank, name in enumerate(files)]
    out = []
    for j in range(k):
        for rank, name in enumerate(files):
            if name is not None and j < len(targets[rank]):
                out.append(Transfer(rank, targets[rank][j], name))
    return out


class PeerGroup:
    """The dedicated gloo group and the transfers run over it."""

    def __init__(self, rank: int, timeout_s: float):
        import torch.distributed as dist

        # A collective on the default group: every rank builds its Checkpointer together.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = rank
        self.broken: str | None = None
        self._buffers: list[torch.Tensor] = []  # receive buffers kept between runs (keep_buffers)
        # The last successful run's perf_counter window and read()/write() time, for the event log.
        self.last_run: dict[str, float] | None = None

    def run(
        self, plan: Sequence[Transfer], read, write, sizes: dict[tuple[int, str], int], keep_buffers: bool = False
    ) -> list[str]:
        """Run this rank's transfers at once; return the files received. On a transport failure
        mark the group broken and raise. A `read` or `write` that fails is this run's error,
        raised once every transfer is done (a file that cannot be read goes as zeros, which its
        receiver's check rejects): the ranks' sends and receives still match, the group stays usable.

        read(file): the uint8 tensor of a file this rank sends; write(file, tensor): store what
        was received (the tensor is valid during the call only); sizes[(src, file)]: lengths.
        keep_buffers: receive into buffers kept for the next run (the sizes repeat).
        """
        import torch.distributed as dist

        if self.broken:
            raise PeerTransferError(f"peer group unusable after an earlier failure: {self.broken}")
        received = []
        record = {"start": time.perf_counter(), "read_s": 0.0, "write_s": 0.0}
        failed: Exception | None = None  # the first read or write that failed
        try:
            incoming = [t for t in plan if t.dst == self.rank]
            bufs = [self._buffer(i, sizes[(t.src, t.file)], keep_buffers) for i, t in enumerate(incoming)]
            recvs = [dist.irecv(buf, src=t.src, group=self.group) for t, buf in zip(incoming, bufs)]
            sends = []
            for t in plan:
                if t.src == self.rank:
                    t0 = time.perf_counter()
                    try:
                        data = read(t.file)
                    except Exception as e:
                        failed = failed or e
                        data = torch.zeros(sizes[(t.src, t.file)], dtype=torch.uint8)
                    record["read_s"] += time.perf_counter() - t0
                    sends.append(dist.isend(data, dst=t.dst, group=self.group))
            for t, buf, work in zip(incoming, bufs, recvs):
                if work is not None:  # None only outside the group, which a plan never asks for
                    work.wait()
                t0 = time.perf_counter()
                try:
                    write(t.file, buf)
                    received.append(t.file)
                except Exception as e:
                    failed = failed or e
                record["write_s"] += time.perf_counter() - t0
            for send in sends:
                if send is not None:
                    send.wait()
        except Exception as e:
            self.broken = one_line(e, 200)
            raise
        if failed is not None:
            raise failed
        record["end"] = time.perf_counter()
        self.last_run = record
        return received

    def _buffer(self, i: int, size: int, keep: bool) -> torch.Tensor:
        if not keep:
            return torch.empty(size, dtype=torch.uint8)
        if i == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[i].numel() < size:
            self._buffers[i] = torch.empty(size, dtype=torch.uint8)
        return self._buffers[i][:size]
