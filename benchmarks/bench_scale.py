"""Coordination at scale: ftkit's real watchdog code for N simulated ranks against a real TCPStore.

    .venv/bin/python benchmarks/bench_scale.py [--ranks 64 1024 16384] [--per-node 8] [--json out.jsonl]

Each size runs in `--procs` worker processes. Every simulated node has a real
node board (files in a private tmpfs directory) where its 7 other ranks write
their heartbeats (each its slot of the node's heartbeat file, coord/beatslots.py),
and one real `Watchdog` for its leader (coord/watchdog.py, only its verdict
actions' `join` replaced: it records a verdict instead of ending the process),
whose store connection counts its requests. Rounds run on a simulated clock, one per
0.5 s heartbeat interval, all workers in step (a barrier on an uncounted
connection), so detection latencies are the protocol's own, whatever this
machine's speed; the CPU each leader spends per round is measured for real, and
so are the store requests, against the store's capacity for the same request
mix measured in the same run (4 client processes, as fast as they can).

Faults, one at a time, each healed (and the verdict key cleared) before the next:
a dead rank (a real process on this host, SIGKILLed: its leader sees it gone), a
dead aggregator (a node's leader falls silent, as a SIGSTOPped or lost one does:
found after `dead_after_s`, 3 s), a hung rank (heartbeats go on, its step stops:
found after its hang bound, 30 s); then `--quiet-s` of nothing. Any
verdict that is not about the fault in its window counts as false.

Then the commit protocol of a shared tier (commit/shared.py: `persist` on every
simulated leader and on rank 0), three steps: every rank's report on its
node's real board, a real part file per node and the index, on tmpfs; and restore
planning (inventories from the node leaders to rank 0, the real planner, the
candidates published and read). Fields: commit_ms (the step's last node record set
-> its index written), commit_store_requests_per_step, index_bytes_per_step,
restore_plan_s (the leaders start -> the candidates published). Then the RAM
tier's commit (commit/ram.py, no replicas; `simulate_ram_commits`):
ram_commit_ms, ram_commit_store_requests_per_step, ram_index_bytes_per_step,
the CPU of a leader's share and of its retention by rank 0's news (coord/news.py),
and the most steps a node without the index held (keep=2: 2).

Beside its figures, the floor of the same work from the same run (`heartbeat_floor`:
the same heartbeat slots written and read, the same store requests, the same packed fields
unpacked, with no ftkit code, for every simulated node, a few rounds): coord_cpu_floor_ms_per_interval
(a leader's CPU per interval), sim_round_floor_s (a round of the whole simulation) and
sim_rounds_floor_s (that, times the rounds: the least the heartbeat part can take here).

Prints a table and one JSON line per size. The baseline is the issue's own
measurement of the previous design (every rank read every heartbeat: 3N^2
requests per interval, 990% of this store's capacity at 256 ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

from common import rmtree

INTERVAL = 0.5
SETTLE = 2  # rounds after a fault heals before its verdict is cleared (its watchers see it back first)
COUNTED = ("set", "get", "check", "multi_get", "add", "append", "compare_set", "wait", "delete_key")


class CountingStore:
    """A c10d store that counts the requests made through it."""

    def __init__(self, store: Any):
        self._store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in COUNTED:
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self.requests += 1
            return attr(*a, **k)

        return call


def capacity_worker(port: int, seconds: float, q: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    name = f"cap/{os.getpid()}"
    store.set(name, "x" * 600)
    keys = [name] * 3
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:  # the leaders' mix: a set, then a multi_get
        store.set(name, "x" * 600)
        store.multi_get(keys)
        n += 2
    q.put(n)


class StoreServer:
    """A TCPStore master in a child process of its own. The benches fork their workers, and a
    fork of a process whose store server thread is running can deadlock (seen once: a capacity
    worker stuck connecting, the bench waiting forever), so no process that forks serves it."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_store, args=(child, timeout_s), daemon=True)
        self.proc.start()
        self.port: int = self._conn.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_store(conn: Any, timeout_s: float) -> None:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    conn.send(server.port)
    with contextlib.suppress(EOFError, OSError):
        conn.recv()  # until told to stop, or the parent is gone


def measure_capacity(port: int, clients: int = 4, seconds: float = 2.0) -> float:
    q: Any = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=capacity_worker, args=(port, seconds, q)) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(q.get() for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def plan_faults(world: int, per: int, quiet_rounds: int) -> list[dict[str, Any]]:
    """Three faults on nodes spread over the ring, each with a window long enough to be found."""
    nodes = world // per
    dead_node, agg_node, hung_node = nodes // 5, (2 * nodes) // 5, (3 * nodes) // 5
    dead_after = 3.0
    out, start = [], 10
    for kind, rank, seconds in (
        ("dead", dead_node * per + min(3, per - 1), 2 * dead_after),
        ("aggregator", agg_node * per, 2 * dead_after),
        ("hung", hung_node * per + min(5, per - 1), 34.0),  # the hang bound is its floor, 30 s
    ):
        out.append({"kind": kind, "rank": rank, "start": start, "heal": start + int(seconds / INTERVAL)})
        start = out[-1]["heal"] + SETTLE + 1
    out.append({"kind": "quiet", "rank": -1, "start": start, "heal": start + quiet_rounds})
    return out


def node_worker(idx: int, procs: int, world: int, per: int, port: int, ram_dir: str, faults: list, q: Any) -> None:
    try:
        q.put(simulate_nodes(idx, procs, world, per, port, ram_dir, faults))
    except BaseException:
        import traceback

        q.put({"error": traceback.format_exc()})


def simulate_nodes(idx: int, procs: int, world: int, per: int, port: int, ram_dir: str, faults: list) -> dict:
    os.environ["FTKIT_RAM_DIR"] = ram_dir
    import torch.distributed as dist

    from ftkit.coord.dist import DistContext, host_identity
    from ftkit.coord.events import EventLog
    from ftkit.coord.judge import Beat, WatchdogConfig
    from ftkit.coord.news import CommitNews
    from ftkit.coord.watchdog import Watchdog

    class SimLeader(Watchdog):
        """A node leader whose verdicts are recorded, not acted on (the process must live on)."""

        sim_now = 0.0

        def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.act.join = self._record  # type: ignore[method-assign]  # (abort() posts, then joins)

        def _record(self, verdict):  # noqa: ANN001, ANN202
            joined.append((self.sim_now, verdict.target, verdict.what, self.ctx.rank))

    joined: list[tuple[float, int, str, int]] = []
    # The rank that will be killed runs as a real process on this host (a sleeper).
    pids = {f["rank"]: (f["pid"], host_identity()) for f in faults if f["kind"] == "dead"}
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    prefix = f"scale{world}/"
    store = CountingStore(dist.PrefixStore(prefix, raw.clone()))
    names = [f"n{r // per}" for r in range(world)]
    cfg = WatchdogConfig()
    mine = list(range(idx, world // per, procs))
    events = EventLog(None, 0)
    t_build = time.perf_counter()
    # Each leader also reads the RAM tier's commit news with its heartbeat, as in a job (coord/news.py).
    leaders = [
        SimLeader(DistContext(n * per, world, store, f"n{n}", 60.0, names, prefix), events, cfg, news=CommitNews())
        for n in mine
    ]
    build_s = time.perf_counter() - t_build
    origin = time.monotonic()
    for wd in leaders:  # the simulated clock starts where the judges' did
        wd.rank_judge.started = wd.ring_judge.started = origin
    seq = {r: 0 for n in mine for r in range(n * per + 1, (n + 1) * per)}
    step = dict(seq)
    last_round = max(f["heal"] for f in faults) + 1
    cpu: list[float] = []
    per_round: list[int] = []
    for k in range(last_round):
        raw.add(f"{prefix}barrier/{k}", 1)  # uncounted: all workers in the same round
        while int(raw.get(f"{prefix}barrier/{k}") if raw.check([f"{prefix}barrier/{k}"]) else 0) < procs:
            time.sleep(0.001)
        active = [f for f in faults if f["start"] <= k < f["heal"]]
        if idx == 0 and any(f["heal"] + SETTLE == k for f in faults):
            store._store.set("wd/verdict", "")  # the fault before is healed: clear its verdict (uncounted)
        raw.add(f"{prefix}barrier2/{k}", 1)
        while int(raw.get(f"{prefix}barrier2/{k}")) < procs:
            time.sleep(0.001)
        now = origin + k * INTERVAL
        dead = {f["rank"] for f in active if f["kind"] in ("dead", "aggregator")}
        hung = {f["rank"] for f in active if f["kind"] == "hung"}
        before = store.requests
        for wd in leaders:
            for r in range(wd.ctx.rank + 1, wd.ctx.rank + per):
                if r in dead:
                    continue
                seq[r] += 1
                if r not in hung:
                    step[r] += 5
                pid, host = pids.get(r, (None, None))
                wd.beats.write(r, Beat(seq[r], step[r], 0.05, 0.1, pid=pid, host_id=host))
            if wd.ctx.rank in dead:
                continue
            if wd.ctx.rank not in hung:
                wd._step = 5 * k
            wd._busy.append(0.05)
            wd._intervals.append(0.1)
            wd._publish()
            wd.sim_now = k * INTERVAL
            c0 = time.thread_time()
            wd._lead(now)
            cpu.append(time.thread_time() - c0)
        per_round.append(store.requests - before)
        for f in faults:  # right after this round: the dead rank's process is killed; at heal, a new one
            if f["kind"] == "dead" and f["rank"] in seq:
                if f["start"] == k + 1:
                    os.kill(f["pid"], signal.SIGKILL)
                elif f["heal"] == k + 1:
                    pids.pop(f["rank"], None)
    loop_s = time.monotonic() - origin
    floor = heartbeat_floor(procs, raw, prefix, leaders, per)
    return {
        "idx": idx,
        "joined": joined,
        "cpu": cpu,
        "per_round": per_round,
        "build_s": build_s,
        "nodes": len(mine),
        "loop_s": loop_s,
        **floor,
    }


FLOOR_ROUNDS = 5


def heartbeat_floor(procs: int, raw: Any, prefix: str, leaders: list, per: int) -> dict:
    """The floor under a heartbeat round: for every node this worker plays, the same board
    bytes and store requests with no ftkit code, on the round's real payloads: its 7 ranks'
    heartbeats written into a slot file (open, pwrite, close each) and read back (one open
    and pread; each slot's checksum and fields unpacked), the node's heartbeat set, the
    watched nodes' and the job's keys read in one multi_get and the node heartbeats'
    fields unpacked. Returns this worker's wall time per round and a leader's CPU per round
    (its half: reads, unpacking, the two requests), medians over FLOOR_ROUNDS rounds run in
    step with the other workers."""
    from ftkit.coord.beatslots import pack_beat

    beat = pack_beat(leaders[0]._beat())
    record = struct.pack("<4sII", b"ftb1", len(beat), zlib.crc32(beat)) + beat
    node_value = leaders[0]._node_beat().pack()
    node_fields = struct.Struct(f"<4sqqBH{2 * per}d")
    beat_fields = struct.Struct("<qqddIBH")
    store = raw.clone()
    for wd in leaders:
        store.set(f"{prefix}floor/node/{wd.node_index}", node_value)
    job_keys = [f"{prefix}floor/{name}" for name in ("waiting", "verdict", "preempt", "done", "news")]
    for key in job_keys:
        store.set(key, "")
    flags = os.O_RDWR | os.O_CREAT
    round_s, cpu = [], []
    for k in range(FLOOR_ROUNDS):
        _barrier(raw, f"{prefix}floor-barrier/{k}", procs)
        t0 = time.perf_counter()
        for wd in leaders:
            path = os.path.join(wd.board.path, "floor.bin")
            for i in range(1, per):  # the ranks' part
                fd = os.open(path, flags, 0o600)
                os.pwrite(fd, record, i * 512)
                os.close(fd)
            c0 = time.thread_time()  # the leader's part
            fd = os.open(path, os.O_RDONLY)
            data = os.pread(fd, per * 512, 0)
            os.close(fd)
            for i in range(1, per):
                _, length, crc = struct.unpack_from("<4sII", data, i * 512)
                payload = data[i * 512 + 12 : i * 512 + 12 + length]
                if zlib.crc32(payload) == crc:
                    beat_fields.unpack_from(payload)
            store.set(f"{prefix}floor/node/{wd.node_index}", node_value)
            values = store.multi_get([f"{prefix}floor/node/{n}" for n in wd.watched] + job_keys)
            for value in values[: len(wd.watched)]:
                node_fields.unpack(value)
            cpu.append(time.thread_time() - c0)
        round_s.append(time.perf_counter() - t0)
    return {"floor_round_s": statistics.median(round_s), "floor_cpu": cpu}


# ------------------------------------------------------------------ commits
COMMIT_STEPS = 3


def commit_worker(idx: int, procs: int, world: int, per: int, port: int, dirs: tuple[str, str], q: Any) -> None:
    import resource

    # Each simulated node's mailbox and a connection to it each way: three descriptors a node.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))
    try:
        shared = simulate_commits(idx, procs, world, per, port, *dirs)
        q.put({**shared, "ram": simulate_ram_commits(idx, procs, world, per, port, dirs[0])})
    except BaseException:
        import traceback

        q.put({"error": traceback.format_exc()})


def simulate_commits(idx: int, procs: int, world: int, per: int, port: int, ram_dir: str, root: str) -> dict:
    """This worker's nodes commit COMMIT_STEPS steps to a shared tier with the real executor
    (commit/shared.py `persist` over the real plan): every other rank's report is posted to
    its node's real board, each leader runs its steps (collect, write its part, set its
    record), rank 0 (worker 0's first node, in a thread of its own from the start) also
    awaits every record and commits. A rank's data file is 64 real bytes of one tensor
    (write_share replaced: the files are written before the step starts)."""
    os.environ["FTKIT_RAM_DIR"] = ram_dir
    import torch.distributed as dist

    from ftkit.commit import shared
    from ftkit.commit.layouts import board_name, layout_of
    from ftkit.commit.memo import CommitMemo
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import SHARED, CommitPlan
    from ftkit.coord.dist import DistContext
    from ftkit.coord.nodelocal import NodeBoard, step_message
    from ftkit.format import codec
    from ftkit.format.manifest import Chunk, Shard, TensorEntry, step_dir_name
    from ftkit.save.write import RankWrite
    from ftkit.tiers.storage import Storage

    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    prefix = f"commit{world}/"
    store = CountingStore(dist.PrefixStore(prefix, raw.clone()))
    root_store = CountingStore(dist.PrefixStore(prefix, raw.clone()))  # rank 0's thread: a connection of its own
    storage = Storage(root)
    index_written = _time_index_writes()
    nodes = world // per
    names = [f"n{r // per}" for r in range(world)]
    members = {n * per: tuple(range(n * per, (n + 1) * per)) for n in range(nodes)}
    mine = list(range(idx, nodes, procs))
    plan = CommitPlan.of(names, SHARED)
    payload = bytes(range(64))
    checksum = codec.checksum(payload)

    def file_of(rank: int, step: int) -> str:
        return f"rank-{rank:05d}-bench{step:03d}.data"

    def write_of(rank: int, step: int) -> RankWrite:
        chunk = Chunk(file_of(rank, step), 0, 64, 0, 64, "raw", checksum)
        tensor = TensorEntry("w", "float32", (16 * world,), (Shard((16 * rank,), (16,), (chunk,), rank),), "sharded")
        return RankWrite(rank, file_of(rank, step), 64, (tensor,))

    shared.write_share = lambda storage, step, slot, pieces, compress, rank: (write_of(rank, step), None)  # type: ignore[assignment]
    groups, ctxs = {}, {}
    for n in mine:
        leader = n * per
        ctxs[n] = DistContext(leader, world, root_store if n == 0 else store, f"n{n}", 120.0, names, prefix)
        board = NodeBoard(f"{prefix}commit/0", f"n{n}", True, "bench", kind="commit")
        groups[n] = NodeGroup(board, plan, f"n{n}", memo=CommitMemo(scale=per))
        board.mailbox(n * per)  # listening from the start, as tiers/opened.py has it
    sender_memo = CommitMemo(scale=world)  # (the other ranks' own: each keeps its layout)
    skeleton = {"entries": {"w": {"kind": "tensor", "value": {"$tensor": "w"}}}}
    out: dict[str, Any] = {"sets": [], "leader_cpu": [], "requests": [], "commit": []}
    gc.disable()  # collections between steps only: a job's persist thread pauses the collector (save/gcpause.py)
    for step in range(1, COMMIT_STEPS + 1):
        gc.collect()
        at, key = (0, step), f"commit/0/0/{step}"
        step_dir = step_dir_name(step)
        messages = {}
        for n in mine:  # what the ranks did before: their data files and their reports
            messages[n] = []
            for r in members[n * per]:
                with open(os.path.join(root, step_dir, file_of(r, step)), "wb") as f:
                    f.write(payload)
                if r != n * per:  # its layout sent once, then its report (StepExecutor.send_report)
                    layout, report = layout_of(write_of(r, step), sender_memo)
                    groups[n].node_board().send_once(board_name(layout.digest), layout.body.encode(), [n * per])
                    messages[n].append((step_message(at, f"w-r{r}"), report.encode()))
        _barrier(raw, f"{prefix}b{step}", procs)
        before = store.requests + root_store.requests

        def run(n: int, step: int = step, key: str = key, at: tuple[int, int] = at, messages: dict = messages):  # noqa: ANN202
            # The node's other ranks send their reports to its leader's mailbox just before it
            # collects (a real rank sends one; here one process sends for all of them).
            for name, message in messages[n]:
                groups[n].node_board().send(name, message, [n * per])
            return shared.persist(
                storage, step, None, skeleton, compress=None, ctx=ctxs[n], key=key, at=at, group=groups[n]
            )

        committing: dict[str, Any] = {}

        def commit(committing: dict[str, Any] = committing) -> None:
            c0 = time.thread_time()
            committing["started"] = time.time()
            try:
                committing["committed"] = run(0)
            except BaseException as e:  # (raised again below)
                committing["error"] = e
            committing["cpu"] = time.thread_time() - c0

        committer = threading.Thread(target=commit, daemon=True) if 0 in mine else None
        if committer is not None:
            committer.start()
        for n in mine:
            if n != 0:
                c0 = time.thread_time()
                run(n)
                out["sets"].append(time.time())
                out["leader_cpu"].append(time.thread_time() - c0)
        if committer is not None:
            committer.join()
            if "error" in committing:
                raise committing["error"]
            # Committed when the index was written (the records' deletion follows it).
            done = {"done": index_written[step], "started": committing["started"], "cpu": committing["cpu"]}
            out["commit"].append({**done, "index_bytes": len(committing["committed"].manifest_json)})
        _barrier(raw, f"{prefix}e{step}", procs)
        out["requests"].append(store.requests + root_store.requests - before)
    if 0 in mine:  # restore planning counts its requests on the shared connection
        ctxs[0] = DistContext(0, world, store, "n0", 120.0, names, prefix)
    out["restore"] = plan_restore(idx, procs, world, per, raw, store, ctxs, mine)
    return out


def plan_restore(idx: int, procs: int, world: int, per: int, raw: Any, store: Any, ctxs: dict, mine: list) -> dict:
    """Restore planning with the real code (restore/__init__.py's first phase): each node's
    leader sends its RAM tier's inventory to rank 0 (its 8 files and the 8 it keeps for
    the node before it; rank 0's also lists the 16,384 files its manifest names, the
    others a digest), rank 0 plans the candidates and publishes them, and every node's
    leader reads them (each rank does, once)."""
    from ftkit.commit.messages import Held, Inventory
    from ftkit.format import codec
    from ftkit.restore.plan import Candidate, order_candidates, ram_candidates

    prefix = f"commit{world}/"
    files = [f"rank-{r:05d}-restore.data" for r in range(world)]
    digest = codec.checksum("\n".join(sorted(files)).encode())
    nodes, leaders = world // per, set(range(0, world, per))
    names = [f"n{r // per}" for r in range(world)]
    _barrier(raw, f"{prefix}r0", procs)
    before, t0 = store.requests, time.time()
    published, root_cpu = None, 0.0
    for n in sorted(mine, reverse=True):  # rank 0 (node 0) last: it waits for the others
        ctx, c0 = ctxs[n], time.thread_time()
        prev = (n - 1) % nodes
        have = files[n * per : (n + 1) * per] + files[prev * per : (prev + 1) * per]
        inv = Inventory((Held(7, tuple(have), tuple(sorted(files)) if n == 0 else None, digest),))
        got = ctx.gather_to_root("restore/inv", inv.encode(), leaders, raw=True)
        if n == 0:
            leader_of = {names[r]: r for r in got}
            decoded = {r: Inventory.decode(raw, f"rank {r}'s inventory") for r, raw in got.items()}
            inventories = [decoded[leader_of[node]] for node in names]
            ram = ram_candidates(inventories, names, 0, True)
            planned = order_candidates(None, ram, [(1, [3, 5])])
            listing = {"candidates": [c.to_json(holders=False) for c in planned], "unreachable": []}
            ctx.broadcast("restore/candidates", listing)
            published = time.time()
            assert planned[0].step == 7 and len(planned[0].holders) == world
            root_cpu = time.thread_time() - c0  # rank 0's own: not the sends of the leaders this process plays
    for n in mine:  # every node's leader reads the plan (every rank does, O(1) each)
        got_listing = ctxs[n].broadcast("restore/candidates") if n != 0 else listing
        assert Candidate.from_json(got_listing["candidates"][0]).step == 7
    _barrier(raw, f"{prefix}r1", procs)
    return {"start": t0, "published": published, "cpu": root_cpu, "requests": store.requests - before}


def simulate_ram_commits(idx: int, procs: int, world: int, per: int, port: int, ram_dir: str) -> dict:
    """This worker's nodes commit COMMIT_STEPS steps to the RAM tier with the real protocol
    (commit/ram.py, no replicas): every rank runs `persist_node_local`: rank 0 in a
    thread of its own (it posts its report to its node's collector, NodeGroup.collector, and
    waits for every node's record), each node's collector in a thread while the node's other
    ranks post to their node's real board and return; rank 0 then commits and publishes the commit news
    (coord/news.py). A rank's "data file" is
    64 real bytes of one tensor (write_share replaced). Every leader then hears the news
    (a read not counted: in a job it rides the heartbeat's multi_get, whose requests the
    watchdog part of this bench counts) and applies its retention (its CPU measured)."""
    os.environ["FTKIT_RAM_DIR"] = ram_dir
    import torch.distributed as dist

    from ftkit.commit import ram as node_commit
    from ftkit.commit.node import NodeGroup
    from ftkit.commit.plan import RAM, CommitPlan
    from ftkit.coord.dist import DistContext
    from ftkit.coord.news import NEWS_KEY, CommitNews, Settled, publish
    from ftkit.coord.nodelocal import NodeBoard
    from ftkit.format import codec
    from ftkit.format.manifest import Chunk, Shard, TensorEntry, step_dir_name
    from ftkit.format.reader import scan
    from ftkit.save.write import RankWrite
    from ftkit.tiers.retention import apply_heard_retention, apply_job_retention
    from ftkit.tiers.storage import Storage

    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    prefix = f"ram{world}/"
    store = CountingStore(dist.PrefixStore(prefix, raw.clone()))
    root_store = CountingStore(dist.PrefixStore(prefix, raw.clone()))  # rank 0's thread: a connection of its own
    uncounted = dist.PrefixStore(prefix, raw.clone())
    nodes = world // per
    names = [f"n{r // per}" for r in range(world)]
    members = {n * per: tuple(range(n * per, (n + 1) * per)) for n in range(nodes)}
    mine = list(range(idx, nodes, procs))
    payload = bytes(range(64))
    checksum = codec.checksum(payload)

    def write_share(storage, step, slot, pieces, compress, rank):  # noqa: ANN001, ANN202
        file = f"rank-{rank:05d}-bench{step:03d}.data"
        storage.write_bytes_atomic(f"{step_dir_name(step)}/{file}", payload)
        chunk = Chunk(file, 0, 64, 0, 64, "raw", checksum)
        tensor = TensorEntry("w", "float32", (16 * world,), (Shard((16 * rank,), (16,), (chunk,), rank),), "sharded")
        return RankWrite(rank, file, 64, (tensor,)), None

    node_commit.write_share = write_share  # type: ignore[assignment]
    # This process plays hundreds of ranks, a node's ranks sharing one NodeGroup. A real rank
    # keeps the few layouts, checks and part templates of its own node and its replica
    # partners (commit/memo.py): a node's memo here gets room for all of its ranks', or every
    # step would refetch and recheck what a real rank has kept.
    from ftkit.commit.memo import CommitMemo

    storages, groups, news = {}, {}, {}
    plan = CommitPlan.of(names, RAM)
    index_written = _time_index_writes()
    for n in mine:
        storages[n] = Storage(os.path.join(ram_dir, "tier", f"n{n}"))
        board = NodeBoard(f"{prefix}commit/0", f"n{n}", True, "bench", kind="commit")
        groups[n] = NodeGroup(board, plan, f"n{n}", memo=CommitMemo(scale=per))
        board.mailbox(groups[n].collector)  # listening from the start, as tiers/opened.py has it
        news[n] = CommitNews()
    skeleton = {"entries": {"w": {"kind": "tensor", "value": {"$tensor": "w"}}}}
    out: dict[str, Any] = {"requests": [], "commit": [], "leader_cpu": [], "retention": [], "held": [], "sets": []}
    gc.disable()  # collections between steps only: a job's persist thread pauses the collector (save/gcpause.py)
    for step in range(1, COMMIT_STEPS + 1):
        gc.collect()
        at, key = (0, step), f"commit/0/0/{step}"
        _barrier(raw, f"{prefix}b{step}", procs)
        before = store.requests + root_store.requests

        def run(rank: int, n: int, step: int = step, key: str = key, at: tuple[int, int] = at):  # noqa: ANN202
            ctx = DistContext(rank, world, root_store if rank == 0 else store, f"n{n}", 120.0, names, prefix)
            return node_commit.persist_node_local(
                storages[n],
                step,
                None,
                skeleton,
                compress=None,
                pieces=None,
                rank_state=None,
                ctx=ctx,
                key=key,
                group=groups[n],
                at=at,
            )

        # Rank 0 posts its report to its node's collector (rank 1: NodeGroup.collector), then
        # waits for every node's record: it runs in a thread of its own, from the start.
        root: dict[str, Any] = {}

        def commit(step: int = step, root: dict[str, Any] = root) -> None:
            c0 = time.thread_time()
            try:
                root["committed"] = run(0, 0)
            except BaseException as e:  # (raised again below)
                root["error"] = e
            root["cpu"] = time.thread_time() - c0

        committer = threading.Thread(target=commit, daemon=True) if 0 in mine else None
        if committer is not None:
            committer.start()

        def collect(n: int, step: int = step) -> None:
            c0 = time.thread_time()
            run(groups[n].collector, n)
            out["sets"].append((step, time.time()))  # its record for rank 0 is set
            if n != 0:
                out["leader_cpu"].append(time.thread_time() - c0)

        for n in mine:  # each node's collector, in a thread, while the node's other ranks post and return
            collector = threading.Thread(target=collect, args=(n,), daemon=True) if groups[n].collector != 0 else None
            if collector is not None:
                collector.start()
            for r in members[n * per]:
                if r not in (0, groups[n].collector):
                    run(r, n)
            if collector is not None:
                collector.join()
        if committer is not None:
            committer.join()
            if "error" in root:
                raise root["error"]
            c0 = time.thread_time()
            done = index_written[step]
            apply_job_retention(storages[0], 2, None, protect=step)  # as the job's (tiers/backend.py)
            publish(store, Settled(0, step, frozenset(d.step for d in scan(storages[0]) if d.committed)))
            out["commit"].append(
                {
                    "step": step,
                    "done": done,
                    "cpu": root["cpu"] + time.thread_time() - c0,
                    "index_bytes": len(root["committed"].manifest_json),
                }
            )
        _barrier(raw, f"{prefix}m{step}", procs)
        for n in mine:  # every other leader hears the news (with its heartbeat) and keeps or drops
            if n != 0:
                c0 = time.thread_time()
                news[n].heard(uncounted.get(NEWS_KEY))
                heard = news[n].of_epoch(0)
                assert heard is not None
                apply_heard_retention(storages[n], heard.settled, heard.kept)
                out["retention"].append(time.thread_time() - c0)
                out["held"].append(len(os.listdir(storages[n].root)))
        _barrier(raw, f"{prefix}e{step}", procs)
        out["requests"].append(store.requests + root_store.requests - before)
    return out


_INDEX_WRITTEN: dict[int, float] = {}


def _time_index_writes() -> dict[int, float]:
    """Patches this worker's Storage (once) to note when each step's index (manifest.json)
    lands: the commit's moment, to the microsecond (a file's mtime ticks every few ms)."""
    from ftkit.tiers.storage import Storage

    write = Storage.write_bytes_atomic
    if getattr(write, "noted", False):
        return _INDEX_WRITTEN

    def noted(self: Any, rel: str, data: bytes, *a: Any, **k: Any) -> Any:
        result = write(self, rel, data, *a, **k)
        found = re.search(r"step-(\d+)/manifest\.json$", rel)
        if found:
            _INDEX_WRITTEN[int(found.group(1))] = time.time()
        return result

    noted.noted = True  # type: ignore[attr-defined]
    Storage.write_bytes_atomic = noted  # type: ignore[method-assign]
    return _INDEX_WRITTEN


def _barrier(raw: Any, key: str, procs: int) -> None:
    raw.add(key, 1)  # uncounted: the workers of one step start together
    while int(raw.get(key)) < procs:
        time.sleep(0.001)


def run_commits(world: int, per: int, procs: int, port: int) -> dict[str, Any]:
    """commit_ms (the last node's record set -> the index written), store requests per step,
    index bytes, and the CPU of a leader's and of rank 0's share, median over the steps."""
    from ftkit.format.manifest import step_dir_name

    ram_dir = tempfile.mkdtemp(prefix="ftkit-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="ftkit-scale-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(ram_dir, 0o700)
    for step in range(1, COMMIT_STEPS + 1):
        os.makedirs(os.path.join(root, step_dir_name(step)))
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    args = (procs, world, per, port, (ram_dir, root), q)
    ps = [ctx.Process(target=commit_worker, args=(i, *args)) for i in range(procs)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=1800) for _ in ps]
    for p in ps:
        p.join()
    rmtree(ram_dir)
    rmtree(root)
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"a commit worker failed:\n{errors[0]}")
    commits = [c for o in outs for c in o["commit"]]
    sets = sorted(t for o in outs for t in o["sets"])
    per_step = len(sets) // COMMIT_STEPS if sets else 0
    latencies = []
    for i, c in enumerate(commits):  # the step's last record set -> its index written
        last = max([c["started"], *sets[i * per_step : (i + 1) * per_step]]) if per_step else c["started"]
        latencies.append(c["done"] - last)
    requests = [sum(x) for x in zip(*(o["requests"] for o in outs))]
    restores = [o["restore"] for o in outs]
    ram = [o["ram"] for o in outs]
    ram_commits = [c for r in ram for c in r["commit"]]
    for c in ram_commits:  # the step's last record set -> its index written
        c["ms"] = max(0.0, c["done"] - max(t for r in ram for step, t in r["sets"] if step == c["step"])) * 1e3
    ram_requests = [sum(x) for x in zip(*(r["requests"] for r in ram))]
    published = next(r["published"] for r in restores if r["published"] is not None)
    return {
        "ram_commit_ms": statistics.median(c["ms"] for c in ram_commits),
        "ram_commit_store_requests_per_step": statistics.median(ram_requests),
        "ram_index_bytes_per_step": statistics.median(c["index_bytes"] for c in ram_commits),
        "ram_commit_root_cpu_ms": statistics.median(c["cpu"] for c in ram_commits) * 1e3,
        "ram_commit_leader_cpu_ms": statistics.median(c for r in ram for c in r["leader_cpu"]) * 1e3,
        "ram_leader_retention_cpu_ms": statistics.median(c for r in ram for c in r["retention"]) * 1e3,
        "ram_leader_steps_held": max(h for r in ram for h in r["held"]),
        "restore_plan_s": published - min(r["start"] for r in restores),
        "restore_plan_store_requests": sum(r["requests"] for r in restores),
        "restore_plan_root_cpu_s": next(r["cpu"] for r in restores if r["published"] is not None),
        "commit_ms": statistics.median(latencies) * 1e3,
        "commit_store_requests_per_step": statistics.median(requests),
        "index_bytes_per_step": statistics.median(c["index_bytes"] for c in commits),
        "commit_leader_cpu_ms": statistics.median(c for o in outs for c in o["leader_cpu"]) * 1e3,
        "commit_root_cpu_ms": statistics.median(c["cpu"] for c in commits) * 1e3,
    }


def run_size(world: int, per: int, procs: int, port: int, capacity: float, quiet_s: float) -> dict[str, Any]:
    ram_dir = tempfile.mkdtemp(prefix="ftkit-scale-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(ram_dir, 0o700)
    faults = plan_faults(world, per, int(quiet_s / INTERVAL))
    sleeper = subprocess.Popen(["sleep", "3600"])  # the dead rank's process, killed at its fault
    faults[0]["pid"] = sleeper.pid
    ctx = mp.get_context("fork")
    q: Any = ctx.Queue()
    t0 = time.perf_counter()
    ps = [ctx.Process(target=node_worker, args=(i, procs, world, per, port, ram_dir, faults, q)) for i in range(procs)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=1800) for _ in ps]
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"a simulation worker failed:\n{errors[0]}")
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    sleeper.kill()
    sleeper.wait()
    rmtree(ram_dir)
    joined = [j for o in outs for j in o["joined"]]
    rounds = [sum(x) for x in zip(*(o["per_round"] for o in outs))]
    steady = rounds[5:]  # after every watched node has been seen (the first rounds also check)
    nodes = world // per
    detect: dict[str, float | None] = {}
    false = []
    for t, target, what, by in joined:
        window = [f for f in faults if f["start"] * INTERVAL <= t <= (f["heal"] + SETTLE) * INTERVAL]
        fault = next((f for f in window if f["rank"] == target), None)
        if fault is None:
            false.append({"t": t, "target": target, "what": what, "by": by})
    for f in faults[:3]:
        hits = [t for t, target, _, _ in joined if target == f["rank"] and t >= f["start"] * INTERVAL]
        # From the last sign of health (the round before the fault), so each is the worst case.
        detect[f["kind"]] = (min(hits) - (f["start"] - 1) * INTERVAL) if hits else None
    cpu = [c for o in outs for c in o["cpu"]]
    req = statistics.median(steady)
    loop_s = max(o["loop_s"] for o in outs)
    floor_round_s = max(o["floor_round_s"] for o in outs)  # the workers run side by side
    return {
        "ranks": world,
        "nodes": nodes,
        "store_requests_per_interval": req,
        "store_requests_per_interval_per_node": req / nodes,
        "store_capacity_rps": round(capacity),
        "store_busy_fraction": req / INTERVAL / capacity,
        "coord_cpu_ms_per_interval": statistics.median(cpu) * 1e3,
        "coord_cpu_ms_per_interval_p99": sorted(cpu)[int(0.99 * (len(cpu) - 1))] * 1e3,
        "coord_cpu_floor_ms_per_interval": statistics.median(c for o in outs for c in o["floor_cpu"]) * 1e3,
        "sim_round_s": loop_s / len(rounds),
        "sim_round_floor_s": floor_round_s,
        "sim_rounds_floor_s": floor_round_s * len(rounds),
        "detect_dead_s": detect["dead"],
        "detect_aggregator_dead_s": detect["aggregator"],
        "detect_hung_s": detect["hung"],
        "hang_bound_s": 30.0,
        "false_verdicts": len(false),
        "false_examples": false[:3],
        "quiet_s": quiet_s,
        "rounds": len(rounds),
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 16384])
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--procs", type=int, default=2, help="worker processes the nodes are spread over")
    p.add_argument("--quiet-s", type=float, default=120.0, help="simulated seconds with no fault, at the end")
    p.add_argument("--json", help="append one JSON line per size here")
    a = p.parse_args()
    rows = []
    with StoreServer() as server:
        capacity = measure_capacity(server.port)
        print(f"store capacity, set + multi_get from 4 client processes: {capacity:,.0f} requests/s", flush=True)
        for world in a.ranks:
            print(f"  .. {world} ranks ({world // a.per_node} nodes)", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            row = run_size(world, a.per_node, a.procs, server.port, capacity, a.quiet_s)
            row.update(run_commits(world, a.per_node, a.procs, server.port))
            row["size_wall_s"] = time.perf_counter() - t0
            row["commit_store_requests_limit"] = 2 * row["nodes"] + 10  # the target
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print()
    cols = ("ranks", "nodes", "req/interval", "busy", "cpu ms/node", "dead", "aggr", "hung", "false")
    cols += ("commit ms", "commit req", "index B", "plan s", "RAM ms", "RAM req", "RAM index B")
    print(" ".join(f"{c:>12}" for c in cols))

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}s"

    for r in rows:
        cells = (
            r["ranks"],
            r["nodes"],
            f"{r['store_requests_per_interval']:.0f}",
            f"{r['store_busy_fraction']:.1%}",
            f"{r['coord_cpu_ms_per_interval']:.2f}",
            secs(r["detect_dead_s"]),
            secs(r["detect_aggregator_dead_s"]),
            secs(r["detect_hung_s"]),
            r["false_verdicts"],
            f"{r['commit_ms']:.0f}",
            f"{r['commit_store_requests_per_step']:.0f}",
            f"{r['index_bytes_per_step']:.0f}",
            f"{r['restore_plan_s']:.2f}",
            f"{r['ram_commit_ms']:.0f}",
            f"{r['ram_commit_store_requests_per_step']:.0f}",
            f"{r['ram_index_bytes_per_step']:.0f}",
        )
        print(" ".join(f"{c:>12}" for c in cells))
    print()
    for r in rows:
        print(
            f"{r['ranks']} ranks: the whole size {r['size_wall_s']:.0f} s; "
            f"heartbeat rounds {r['sim_round_s']:.3f} s each "
            f"x {r['rounds']} (floor {r['sim_round_floor_s']:.3f} s: the same board writes and store requests, "
            f"no ftkit code: {r['sim_rounds_floor_s']:.0f} s for the rounds); a leader's CPU per interval "
            f"{r['coord_cpu_ms_per_interval']:.2f} ms (floor {r['coord_cpu_floor_ms_per_interval']:.2f} ms)"
        )
    print("previous design (every rank read every heartbeat): 3N^2 requests per interval, e.g. 196,096 at 256 ranks;")
    print("commits: rank 0 read one report per rank, one round trip each, and wrote every rank's entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
