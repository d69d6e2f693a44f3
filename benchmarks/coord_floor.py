"""The floor under a RAM-tier commit's coordination: the same files, store requests and JSON
documents a rank handles per snapshot, with no ftkit code (bench_dist.py's train phase).

Per snapshot of `["ram", replicas=1]` on 2 simulated nodes, each rank's share of the commit
(save/node_commit.py) moves these bytes; here each is one plain call (os, json, the c10d
store), on the real payloads of the run's last committed step, with nothing waited for
(every file read is there already, every key is set already):

    every rank:    its report to the board (temp file + rename); the relayed peer reports
                   read and parsed; its outcome to the board (save/commit.py NodeGroup has
                   the roles: a node's collector is its first rank, on rank 0's node the next)
    a collector:   instead, its ranks' reports read and parsed; its node's part written
                   (temp file, fsync, rename, fsync of the directory); its node's record set
                   in the store; its replica partner's record waited for, read and parsed;
                   that record relayed to its ranks (a board file); its ranks' outcomes
                   read; its record for rank 0 set (not on rank 0)
    an exchanger:  (a node's first rank that neither collects nor commits, else its collector)
                   also the partner's part written; on a node holding rank 0's replicas the
                   index read from the store, parsed, written
    rank 0:        also every node's record for it waited for, read and parsed; the index
                   encoded (JSON) and written; set in the store for the index holders; the
                   step's keys deleted

The floor runs in a background thread during training steps, as the persist thread does,
and is that thread's CPU time per snapshot.
"""

from __future__ import annotations

import json
import os
import queue
import select
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
        first = self.node * per_node
        ranks = list(range(first, first + per_node))
        # The roles of save/commit.py NodeGroup: on rank 0's node another rank collects.
        self.collector_rank = ranks[1] if first == 0 and per_node > 1 else first
        self.collector = rank == self.collector_rank
        self.exchanger = rank == next((r for r in ranks if r not in (0, self.collector_rank)), self.collector_rank)
        self.mates = [r for r in ranks if r != rank]  # the node's other ranks
        self.leaders = list(range(0, world, per_node))  # the nodes' names in the keys
        self.partner = self.leaders[(self.node + 1) % len(self.leaders)]  # k = 1: the next node, both ways
        self.holder = self.exchanger and self.node == 1  # its node holds rank 0's replicas (k = 1)
        self.records = [n for n in self.leaders if n != 0 or per_node > 1]  # what rank 0 reads
        self.dir = os.path.join(root, f"floor-r{rank}")
        self.store, self.p = store, payloads
        self.index_doc = json.loads(payloads["index"])

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        for r in range(self.per_node - 1):  # what this rank reads: there already
            board_write(os.path.join(self.dir, f"w-{r}"), self.p["report"])
            board_write(os.path.join(self.dir, f"r-{r}"), self.p["outcome"])
        board_write(os.path.join(self.dir, "peers"), self.p["record"])
        if self.collector:
            self.store.set(f"floor/w/{self.node * self.per_node}", self.p["record"])
            self.store.set(f"floor/r/{self.node * self.per_node}", self.p["node_record"])
        if self.rank == 0:
            self.store.set("floor/manifest", self.p["index"])

    def once(self) -> None:
        d, p, store = self.dir, self.p, self.store
        node = self.node * self.per_node
        if not self.collector:
            board_write(os.path.join(d, "mine"), p["report"])
            json.loads(read_file(os.path.join(d, "peers")))
            if self.exchanger:
                _durable_write(os.path.join(d, "partner-part.json"), p["part"])
            board_write(os.path.join(d, "outcome"), p["outcome"])
        else:
            for r in range(self.per_node - 1):
                json.loads(read_file(os.path.join(d, f"w-{r}")).partition(b"\n")[0])
            _durable_write(os.path.join(d, "part.json"), p["part"])
            store.set(f"floor/w/{node}", p["record"])
            store.wait([f"floor/w/{self.partner}"], timedelta(seconds=60))
            (record,) = store.multi_get([f"floor/w/{self.partner}"])
            json.loads(record)
            board_write(os.path.join(d, "relay"), record)
            if self.exchanger:
                _durable_write(os.path.join(d, "partner-part.json"), p["part"])
            for r in range(self.per_node - 1):
                json.loads(read_file(os.path.join(d, f"r-{r}")))
            if self.rank != 0:
                store.set(f"floor/r/{node}", p["node_record"])
        if self.rank == 0:
            self._commit()
        if self.holder:
            store.wait(["floor/manifest"], timedelta(seconds=60))
            json.loads(store.get("floor/manifest"))
            _durable_write(os.path.join(d, "manifest.json"), p["index"])

    def _commit(self) -> None:
        keys = [f"floor/r/{n}" for n in self.records]
        self.store.wait(keys, timedelta(seconds=60))
        for raw in self.store.multi_get(keys):
            json.loads(raw)
        index = json.dumps(self.index_doc, separators=(",", ":")).encode()
        _durable_write(os.path.join(self.dir, "manifest.json"), index)
        self.store.set("floor/manifest-step", index)
        for key in [f"floor/gone-r{n}" for n in self.records] + [f"floor/gone-w{n}" for n in self.leaders]:
            self.store.delete_key(key)  # the step's records, the exchanged ones


class HandshakeFloor(Floor):
    """The same floor with the commit's handshakes: each message is waited for, as ftkit's ranks
    wait for each other (a doorbell, a named pipe, for a board file; a blocking store request
    for a key), so the floor pays what every wait costs besides the bytes. On this VM a thread
    woken from a wait pays tens of microseconds of CPU in its next system calls (cold caches and
    TLB): the `Floor` above, which finds everything in place, never sleeps and never pays it.

    Per snapshot, in ftkit's order (save/node_commit.py; no replicas are moved, so no wait on
    them): a rank posts its report and rings its collector; the collector waits for its ranks'
    reports, writes the part, sets its record, gets its partner's (one blocking multi_get),
    relays it and rings its ranks; the ranks wait for the relay, post their outcomes and ring;
    the collector waits for them and sets its record for rank 0; rank 0 gets every node's
    record, writes the index, sets it for the holders and deletes the step's keys; a holder's
    exchanger gets the index and writes it. Keys and files are named by round."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dir = os.path.join(os.path.dirname(self.dir), f"floor-wait-n{self.node}")  # one per node
        self.round = 0
        self._bell = self._keep = -1  # this rank's doorbell: its read end, and a write end kept open

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        path = self._bell_path(self.rank)
        if not os.path.exists(path):
            os.mkfifo(path, 0o600)
        self._bell = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._keep = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # never reads as closed

    def _bell_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"bell-{rank}")

    def _ring(self, rank: int) -> None:
        fd = os.open(self._bell_path(rank), os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)

    def _wait_file(self, name: str) -> bytes:
        path = os.path.join(self.dir, name)
        while True:
            try:
                return read_file(path)
            except FileNotFoundError:
                if select.select([self._bell], [], [], 1.0)[0]:
                    os.read(self._bell, 4096)

    def once(self) -> None:
        self.round += 1
        d, p, store, r = self.dir, self.p, self.store, self.round
        node = self.node * self.per_node
        if not self.collector:
            board_write(os.path.join(d, f"w-{self.rank}-{r}"), p["report"])
            self._ring(self.collector_rank)
            json.loads(self._wait_file(f"peers-{r}"))
            if self.exchanger:
                _durable_write(os.path.join(d, f"partner-part-{self.rank}.json"), p["part"])
            board_write(os.path.join(d, f"o-{self.rank}-{r}"), p["outcome"])
            self._ring(self.collector_rank)
        else:
            for q in self.mates:
                json.loads(self._wait_file(f"w-{q}-{r}").partition(b"\n")[0])
                os.unlink(os.path.join(d, f"w-{q}-{r}"))
            _durable_write(os.path.join(d, "part.json"), p["part"])
            store.set(f"floorw/{r}/w/{node}", p["record"])
            (record,) = store.multi_get([f"floorw/{r}/w/{self.partner}"])  # (it waits for the key)
            json.loads(record)
            board_write(os.path.join(d, f"peers-{r}"), record)
            for q in self.mates:
                self._ring(q)
            if self.exchanger:
                _durable_write(os.path.join(d, f"partner-part-{self.rank}.json"), p["part"])
            for q in self.mates:
                json.loads(self._wait_file(f"o-{q}-{r}"))
                os.unlink(os.path.join(d, f"o-{q}-{r}"))
            if r > 1:
                os.unlink(os.path.join(d, f"peers-{r - 1}"))
            if self.rank != 0:
                store.set(f"floorw/{r}/r/{node}", p["node_record"])
        if self.rank == 0:
            keys = [f"floorw/{r}/r/{n}" for n in self.records]
            for raw in store.multi_get(keys):
                json.loads(raw)
            index = json.dumps(self.index_doc, separators=(",", ":")).encode()
            _durable_write(os.path.join(d, "manifest.json"), index)
            store.set(f"floorw/{r}/manifest", index)
            old = [f"floorw/{r - 1}/manifest"] if r > 1 else []
            for key in old + keys + [f"floorw/{r}/w/{n}" for n in self.leaders]:
                store.delete_key(key)
        if self.holder:
            json.loads(store.get(f"floorw/{r}/manifest"))
            _durable_write(os.path.join(d, "manifest.json"), p["index"])


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
