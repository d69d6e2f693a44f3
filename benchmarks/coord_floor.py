"""The floor under a RAM-tier commit's coordination: the same files, store requests and JSON
documents a rank handles per snapshot, with no ftkit code (bench_dist.py's train phase).

Per snapshot of `["ram", replicas=1]` on 2 simulated nodes, each rank's share of the commit
(save/node_commit.py) moves these bytes; here each is one plain call (os, json, the c10d
store), on the real payloads of the run's last committed step, with nothing waited for
(every file read is there already, every key is set already):

    a non-leader:  its report to the board (temp file + rename); the relayed peer reports
                   read and parsed; its outcome to the board; the node's exchanger (its
                   second rank) also the partner's part written (temp file, fsync, rename,
                   fsync of the directory)
    a leader:      its ranks' reports read and parsed; its node's part written; its node's
                   record set in the store; its replica partner's record waited for, read and
                   parsed; that record relayed to its ranks (a board file); its ranks'
                   outcomes read; (not rank 0) its record for rank 0 set
    rank 0:        the other leaders' records waited for, read and parsed; the index encoded
                   (JSON) and written; set in the store for the index holders; the step's
                   keys deleted
    an index holder (the exchanger of a node holding rank 0's replicas): the index read
                   from the store, parsed, written

The floor runs in a background thread during training steps, as the persist thread does,
and is that thread's CPU time per snapshot.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def board_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, os.fstat(fd).st_size + 1)
    finally:
        os.close(fd)


def _durable_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Floor:
    """One rank's floor: `prepare` once (every rank, then a barrier), `once()` per snapshot."""

    def __init__(self, rank: int, world: int, per_node: int, root: str, store: Any, payloads: dict[str, bytes]):
        self.rank, self.world, self.per_node = rank, world, per_node
        self.node = rank // per_node
        self.leader = rank % per_node == 0
        self.exchanger = rank % per_node == min(1, per_node - 1)  # its node's second rank (the leader if alone)
        self.leaders = list(range(0, world, per_node))
        self.partner = self.leaders[(self.node + 1) % len(self.leaders)]  # k = 1: the next node, both ways
        self.holder = self.exchanger and self.node == 1  # its node holds rank 0's replicas (k = 1)
        self.dir = os.path.join(root, f"floor-r{rank}")
        self.store, self.p = store, payloads
        self.index_doc = json.loads(payloads["index"])

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        for r in range(self.per_node - 1):  # what this rank reads: there already
            board_write(os.path.join(self.dir, f"w-{r}"), self.p["report"])
            board_write(os.path.join(self.dir, f"r-{r}"), self.p["outcome"])
        board_write(os.path.join(self.dir, "peers"), self.p["record"])
        if self.leader:
            self.store.set(f"floor/w/{self.rank}", self.p["record"])
        if self.rank == 0:
            self.store.set("floor/manifest", self.p["index"])
        for leader in self.leaders[1:]:
            if self.rank == leader:
                self.store.set(f"floor/r/{leader}", self.p["node_record"])

    def once(self) -> None:
        d, p, store = self.dir, self.p, self.store
        wait = timedelta(seconds=60)
        if not self.leader:
            board_write(os.path.join(d, "mine"), p["report"])
            json.loads(read_file(os.path.join(d, "peers")))
            if self.exchanger:
                _durable_write(os.path.join(d, "partner-part.json"), p["part"])
            board_write(os.path.join(d, "outcome"), p["outcome"])
            self._hold_index()
            return
        for r in range(self.per_node - 1):
            json.loads(read_file(os.path.join(d, f"w-{r}")).partition(b"\n")[0])
        _durable_write(os.path.join(d, "part.json"), p["part"])
        store.set(f"floor/w/{self.rank}", p["record"])
        store.wait([f"floor/w/{self.partner}"], wait)
        (record,) = store.multi_get([f"floor/w/{self.partner}"])
        json.loads(record)
        board_write(os.path.join(d, "relay"), record)
        if self.exchanger:  # a node of one rank
            _durable_write(os.path.join(d, "partner-part.json"), p["part"])
        for r in range(self.per_node - 1):
            json.loads(read_file(os.path.join(d, f"r-{r}")))
        if self.rank != 0:
            store.set(f"floor/r/{self.rank}", p["node_record"])
        else:
            keys = [f"floor/r/{leader}" for leader in self.leaders[1:]]
            store.wait(keys, wait)
            for raw in store.multi_get(keys):
                json.loads(raw)
            index = json.dumps(self.index_doc, separators=(",", ":")).encode()
            _durable_write(os.path.join(d, "manifest.json"), index)
            store.set("floor/manifest-step", index)
            for key in ("floor/gone-1", "floor/gone-2", "floor/gone-3"):  # the step's records, the exchanged
                store.delete_key(key)
        self._hold_index()

    def _hold_index(self) -> None:
        if self.holder:
            self.store.wait(["floor/manifest"], timedelta(seconds=60))
            json.loads(self.store.get("floor/manifest"))
            _durable_write(os.path.join(self.dir, "manifest.json"), self.p["index"])


def measure(floor: Floor, train_step: Callable[[int], Any], steps: int, first_step: int) -> float:
    """The median CPU seconds of `floor.once()` in a background thread, one per training step."""
    jobs: queue.Queue[int | None] = queue.Queue()
    cpu: list[float] = []

    def run() -> None:
        while jobs.get() is not None:
            c0 = time.thread_time()
            floor.once()
            cpu.append(time.thread_time() - c0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for i in range(steps):
        train_step(first_step + i)
        jobs.put(i)
    jobs.put(None)
    thread.join()
    return statistics.median(cpu[2:] or cpu)
