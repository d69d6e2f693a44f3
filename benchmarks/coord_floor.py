"""The floor under a RAM-tier commit's coordination: the same files, store requests, messages
and JSON documents a rank handles per snapshot, with no ftkit code (bench_dist.py's train
phase). The commit's binary messages are read by splitting their bytes (`_fields`), the
reports' heads and the index parsed as JSON.

Per snapshot of `["ram", replicas=1]` on 2 simulated nodes, each rank's share of the commit
(commit/ram.py) moves these bytes; here each is one plain call (os, json, the c10d
store, a socket), on the real payloads of the run's last committed step, with nothing
waited for (every message received is queued already, every key is set already):

    every rank:    its report to its collector (a datagram: the cheapest message between two
                   processes; ftkit's board keeps a stream connection to each mailbox,
                   coord/mailbox.py, which benchmarks/board_messages.py sets beside it);
                   the relayed peer reports received and parsed
                   (rank 0: its partner's record and its own node's read from the store);
                   its outcome sent, but by rank 0, which keeps its own (commit/shared.py
                   NodeGroup has the roles: a node's collector is its first rank, on rank
                   0's node the next)
    a collector:   instead, its ranks' reports received and parsed; its node's part written
                   (temp file, rename; fsyncs of it and its directory where not in memory);
                   its node's record set in the store; its replica partner's record waited
                   for, read and parsed; that record relayed to its ranks but rank 0 (a
                   datagram each);
                   its ranks' outcomes received (not rank 0's); its record for rank 0 set
                   (not on rank 0)
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

import contextlib
import json
import os
import queue
import select
import socket
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, os.fstat(fd).st_size + 1)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes, sync: bool) -> None:
    """A temporary file renamed into place; fsynced, and its directory, where that makes it durable
    (`sync`: not in memory, where ftkit's Storage skips the fsyncs too)."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _box(path: str) -> socket.socket:
    """A datagram socket bound at `path`: a rank's mailbox at its cheapest."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    return sock


class Floor:
    """One rank's floor: `prepare` once (every rank, then a barrier), then per snapshot `stage()`
    (not measured: puts in place what the rank reads) and `once()` (measured)."""

    def __init__(self, rank: int, world: int, per_node: int, root: str, store: Any, payloads: dict[str, bytes]):
        self.rank, self.world, self.per_node = rank, world, per_node
        self.node = rank // per_node
        first = self.node * per_node
        ranks = list(range(first, first + per_node))
        # The roles of commit/shared.py NodeGroup: on rank 0's node another rank collects.
        self.collector_rank = ranks[1] if first == 0 and per_node > 1 else first
        self.collector = rank == self.collector_rank
        self.exchanger = rank == next((r for r in ranks if r not in (0, self.collector_rank)), self.collector_rank)
        self.mates = [r for r in ranks if r != rank]  # the node's other ranks
        self.senders = [r for r in self.mates if r != 0]  # its relay and its outcome collect skip rank 0
        self.leaders = list(range(0, world, per_node))  # the nodes' names in the keys
        self.partner = self.leaders[(self.node + 1) % len(self.leaders)]  # k = 1: the next node, both ways
        self.holder = self.exchanger and self.node == 1  # its node holds rank 0's replicas (k = 1)
        self.records = [n for n in self.leaders if n != 0 or per_node > 1]  # what rank 0 reads
        self.dir = os.path.join(root, f"floor-r{rank}")
        self.store, self.p = store, payloads
        self.index_doc = json.loads(payloads["index"])
        from ftkit.tiers.localfs import on_volatile_fs  # (set-up only: what ftkit's Storage decides there)

        self.sync = not on_volatile_fs(root)
        self._inbox: dict[bytes, bytes] = {}

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.box = _box(os.path.join(self.dir, "box"))  # what this rank reads comes here
        self.sink = _box(os.path.join(self.dir, "sink"))  # what it sends goes here
        self.sink_path = os.path.join(self.dir, "sink")
        self.box.setblocking(False)
        self.sink.setblocking(False)
        self.sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if self.collector:
            self.store.set(f"floor/w/{self.node * self.per_node}", self.p["record"])
            self.store.set(f"floor/r/{self.node * self.per_node}", self.p["node_record"])
        if self.rank == 0:
            self.store.set("floor/manifest", self.p["index"])

    def stage(self) -> None:
        """Empty the sink; queue in this rank's mailbox what it reads this round (each a datagram,
        as ftkit's messages are: the name, a zero byte, the payload)."""
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sink.recv(1 << 17)
        box = os.path.join(self.dir, "box")
        mates = len(self.mates) if self.collector else 0
        senders = len(self.senders) if self.collector else 0
        incoming = [b"w\0" + self.p["report"]] * mates + [b"r\0" + self.p["outcome"]] * senders
        if not self.collector:
            incoming = [b"peers\0" + self.p["record"]] if self.rank != 0 else []
        for frame in incoming:
            self.sender.sendto(frame, box)

    def _send(self, frame: bytes) -> None:
        self.sender.sendto(frame, self.sink_path)

    def _receive(self) -> bytes:
        return self.box.recv(1 << 17).partition(b"\0")[2]

    def once(self) -> None:
        d, p, store = self.dir, self.p, self.store
        node = self.node * self.per_node
        if not self.collector:
            self._send(b"w\0" + p["report"])
            if self.rank == 0:  # its partner's record and its own node's, from the store
                for raw in store.multi_get([f"floor/w/{self.partner}", f"floor/w/{node}"]):
                    _fields(raw)
            else:
                _fields(self._receive())
            if self.exchanger:
                _atomic_write(os.path.join(d, "partner-part.json"), p["part"], self.sync)
            if self.rank != 0:
                self._send(b"r\0" + p["outcome"])
        else:
            for _ in self.mates:
                _fields(self._receive())
            _atomic_write(os.path.join(d, "part.json"), p["part"], self.sync)
            store.set(f"floor/w/{node}", p["record"])
            store.wait([f"floor/w/{self.partner}"], timedelta(seconds=60))
            (record,) = store.multi_get([f"floor/w/{self.partner}"])
            _fields(record)
            for _ in self.senders:
                self._send(b"peers\0" + record)
            if self.exchanger:
                _atomic_write(os.path.join(d, "partner-part.json"), p["part"], self.sync)
            for _ in self.senders:
                _fields(self._receive())
            if self.rank != 0:
                store.set(f"floor/r/{node}", p["node_record"])
        if self.rank == 0:
            self._commit()
        if self.holder:
            store.wait(["floor/manifest"], timedelta(seconds=60))
            json.loads(store.get("floor/manifest"))
            _atomic_write(os.path.join(d, "manifest.json"), p["index"], self.sync)

    def _commit(self) -> None:
        keys = [f"floor/r/{n}" for n in self.records]
        self.store.wait(keys, timedelta(seconds=60))
        for raw in self.store.multi_get(keys):
            _fields(raw)
        index = json.dumps(self.index_doc, separators=(",", ":")).encode()
        _atomic_write(os.path.join(self.dir, "manifest.json"), index, self.sync)
        self.store.set("floor/manifest-step", index)
        for key in [f"floor/gone-r{n}" for n in self.records] + [f"floor/gone-w{n}" for n in self.leaders]:
            self.store.delete_key(key)  # the step's records, the exchanged ones


def _fields(raw: bytes) -> list[bytes]:
    """A commit message (a record, an outcome, an exchange or a relay: commit/messages.py) read
    the cheapest way, with no ftkit code: its header checked, its bytes split on NUL."""
    if raw[:4] != b"FTKM":
        raise ValueError("not a commit message")
    return raw[6:].split(b"\0")


class HandshakeFloor(Floor):
    """The same floor with the commit's handshakes: each message is waited for, as ftkit's ranks
    wait for each other (a datagram to the rank's mailbox for a board message; a blocking store
    request for a key), so the floor pays what every wait costs besides the bytes. On this VM a
    thread woken from a wait pays tens of microseconds of CPU in its next system calls (cold
    caches and TLB): the `Floor` above, which finds everything in place, never sleeps and never
    pays it.

    Per snapshot, in ftkit's order (commit/ram.py; no replicas are moved, so no wait on
    them): a rank sends its report to its collector; the collector waits for its ranks'
    reports, writes the part, sets its record, gets its partner's (one blocking multi_get),
    relays it to its ranks but rank 0, which gets both records itself (one blocking multi_get);
    the ranks wait for the relay and send their outcomes (but rank 0);
    the collector waits for them and sets its record for rank 0; rank 0 gets every node's record,
    writes the index, sets it for the holders and deletes the step's keys; a holder's exchanger
    gets the index and writes it. Keys and messages are named by round."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dir = os.path.join(os.path.dirname(self.dir), f"floor-wait-n{self.node}")  # one per node
        self.round = 0

    def prepare(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self.box = _box(self._box_path(self.rank))
        self.box.setblocking(False)
        self.sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def stage(self) -> None:
        pass  # everything comes from the other ranks, waited for

    def _box_path(self, rank: int) -> str:
        return os.path.join(self.dir, f"box-{rank}")

    def _send_to(self, rank: int, name: str, payload: bytes) -> None:
        self.sender.sendto(name.encode() + b"\0" + payload, self._box_path(rank))

    def _wait_for(self, name: str) -> bytes:
        want = name.encode()
        while want not in self._inbox:
            select.select([self.box], [], [], 1.0)
            with contextlib.suppress(BlockingIOError):
                got, _, payload = self.box.recv(1 << 17).partition(b"\0")
                self._inbox[got] = payload
        return self._inbox.pop(want)

    def once(self) -> None:
        self.round += 1
        d, p, store, r = self.dir, self.p, self.store, self.round
        node = self.node * self.per_node
        if not self.collector:
            self._send_to(self.collector_rank, f"w-{self.rank}-{r}", p["report"])
            if self.rank == 0:  # (multi_get waits for the keys)
                for raw in store.multi_get([f"floorw/{r}/w/{self.partner}", f"floorw/{r}/w/{node}"]):
                    _fields(raw)
            else:
                _fields(self._wait_for(f"peers-{r}"))
            if self.exchanger:
                _atomic_write(os.path.join(d, f"partner-part-{self.rank}.json"), p["part"], self.sync)
            if self.rank != 0:
                self._send_to(self.collector_rank, f"o-{self.rank}-{r}", p["outcome"])
        else:
            for q in self.mates:
                _fields(self._wait_for(f"w-{q}-{r}"))
            _atomic_write(os.path.join(d, "part.json"), p["part"], self.sync)
            store.set(f"floorw/{r}/w/{node}", p["record"])
            (record,) = store.multi_get([f"floorw/{r}/w/{self.partner}"])  # (it waits for the key)
            _fields(record)
            for q in self.senders:
                self._send_to(q, f"peers-{r}", record)
            if self.exchanger:
                _atomic_write(os.path.join(d, f"partner-part-{self.rank}.json"), p["part"], self.sync)
            for q in self.senders:
                _fields(self._wait_for(f"o-{q}-{r}"))
            if self.rank != 0:
                store.set(f"floorw/{r}/r/{node}", p["node_record"])
        if self.rank == 0:
            keys = [f"floorw/{r}/r/{n}" for n in self.records]
            for raw in store.multi_get(keys):
                _fields(raw)
            index = json.dumps(self.index_doc, separators=(",", ":")).encode()
            _atomic_write(os.path.join(d, "manifest.json"), index, self.sync)
            store.set(f"floorw/{r}/manifest", index)
            old = [f"floorw/{r - 1}/manifest"] if r > 1 else []
            for key in old + keys + [f"floorw/{r}/w/{n}" for n in self.leaders]:
                store.delete_key(key)
        if self.holder:
            json.loads(store.get(f"floorw/{r}/manifest"))
            _atomic_write(os.path.join(d, "manifest.json"), p["index"], self.sync)


def measure(floor: Floor, train_step: Callable[[int], Any], steps: int, first_step: int) -> float:
    """The median CPU seconds of `floor.once()` in a background thread, one per training step."""
    jobs: queue.Queue[int | None] = queue.Queue()
    cpu: list[float] = []

    def run() -> None:
        while jobs.get() is not None:
            floor.stage()
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
