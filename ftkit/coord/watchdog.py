"""Heartbeats and failure detection, hierarchical: dead, hung, failed and straggling ranks
found in O(1) store requests per node per interval, whatever the world size.

    rank ─local file─▶ node leader ─one key per node─▶ the store ◀─ the next `watch` nodes' leaders
                 ◀──── verdict relayed ◀──── one verdict key, first judge wins

Ranks beat to their node's board (coord/nodelocal.py). The node leader judges them
(judge.py), publishes one node heartbeat, and with one multi_get reads the verdict, a
preemption, the finished count, the RAM commit news and its ring's node heartbeats. Other
ranks read the board and judge their leader. Ranks that learn a verdict kill the target if
it is a process on this host (dist.host_identity, and the start time its beat recorded) and
end with `os._exit` (``sys.exit`` in a thread ends only the thread; runtime/verdict_actions.py).

No false kills: a leader that cannot reach the store judges nobody and its clocks freeze,
unless the store stays silent for `store_lost_after_s`: then it is taken for lost with its
host and the node's workers end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from datetime import timedelta
from typing import Any

from ftkit.coord.dist import DistContext, host_identity
from ftkit.coord.events import EventLog
from ftkit.coord.judge import Beat, NodeBeat, RankJudge, RingJudge, Verdict, WatchdogConfig, ring
from ftkit.coord.news import NEWS_KEY, CommitNews
from ftkit.coord.nodelocal import NodeBoard
from ftkit.coord.preemption import PreemptionHandler, parse_preemption_notice, preemption_notice
from ftkit.format.validate import parse_message, rank_key
from ftkit.runtime.verdict_actions import VERDICT, VerdictActions
from ftkit.runtime.warm.client import process_gone, process_start, process_stopped  # (the client asks too)

log = logging.getLogger("ftkit")
PREEMPT, DONE = "wd/preempt", "wd/done"
# Nodes where a rank has waited inside ftkit for a while: the other ranks wait for it in their
# collectives, so while any does nobody's step clock runs (added to only after a long wait:
# at most two requests per node per such wait, fewer than its heartbeats).
WAITING = "wd/waiting"


class BoundedCall:
    """Calls made one at a time on a daemon thread of their own, each waited for at most a
    bound: the caller gets the result, the call's exception, or a TimeoutError. While a call
    is still out (stuck for good), the next fails at once: nothing piles up behind it.
    `close()` ends the thread once its call is back (a later call starts another)."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._todo: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._out: Future[Any] | None = None  # the last call's

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        with self._lock:
            if self._out is None:  # (not a ThreadPoolExecutor: exiting would wait for a call stuck for good)
                threading.Thread(target=self._serve, args=(self._todo,), name=self.name, daemon=True).start()
            elif not self._out.done():
                raise TimeoutError(f"{self.name}: the previous call has not returned")
            self._out = out = Future[Any]()
            self._todo.put((fn, out))
        if not wait([out], timeout_s).done:
            raise TimeoutError(f"{self.name}: no answer within {timeout_s:g}s")
        return out.result()

    def close(self) -> None:
        with self._lock:
            if self._out is not None:
                self._todo.put(None)
                self._todo, self._out = queue.SimpleQueue(), None

    @staticmethod
    def _serve(todo: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
        while (job := todo.get()) is not None:
            fn, out = job
            try:
                out.set_result(fn())
            except BaseException as e:  # handed to the caller, raised there
                out.set_exception(e)


class Watchdog:
    def __init__(
        self,
        ctx: DistContext,
        events: EventLog,
        config: WatchdogConfig | None = None,
        flush: Callable[[float], None] | None = None,
        preemption: PreemptionHandler | None = None,
        news: CommitNews | None = None,
    ):
        """`ctx`: a connection of the watchdog's own (DistContext.own_connection). `news`: where
        a leader puts the RAM commit news it reads (coord/news.py)."""
        self.ctx = ctx
        self.events = events
        self.cfg = cfg = config or WatchdogConfig()
        self._preemption = preemption  # the signal this rank got is told to peers, and theirs to it
        self._news = news
        self._step: int | None = None  # None until the first step ends: no hang clock before it
        # A straggler's busy time: the median of the last 10 steps turns once 6 of them are slow.
        self._busy: deque[float] = deque(maxlen=10)
        self._intervals: deque[float] = deque(maxlen=20)
        self._step_started = time.monotonic()
        self._first_grad: float | None = None
        self._seq = 0
        self._host_id = host_identity()  # whose pids we may look up and kill (None: nobody's)
        self._start = process_start(os.getpid())  # with the pid in each beat: this process, not a reuser of its pid
        self._finished = False  # finish() was called: heartbeats say "done"
        self._waiting = 0  # the training thread's waits inside ftkit now open (waiting())
        self._job_waiting = False  # a leader's: some node has a rank waiting inside ftkit (WAITING)
        self._node_wait_since: float | None = None  # a leader's: since when a rank of its node waits
        self._announce = self._announced = False  # a leader's: its node counted in WAITING
        self._all_done = False  # every rank of every node has finished
        self._stop = threading.Event()  # the heartbeat thread must end (stop(), or an in-process verdict)
        self._stopped_once = False  # stop() ran: its cleanup is done once
        self._outage_since: float | None = None
        self._outage_rounds = 0
        # A store request to a host that vanished (no FIN, no RST) never returns, whatever the
        # client's timeout: exchanges run on a thread of their own, waited for this long.
        self._store = BoundedCall("ftkit-watchdog-store")
        self._store_wait_s = max(cfg.dead_after_s / 2, cfg.interval_s)
        self._last_round: float | None = None
        self._told_preempt = False  # this rank's preemption was posted
        self._heard_preempt = False  # a peer's preemption was passed on to `preemption`
        self._thread: threading.Thread | None = None
        now = time.monotonic()
        # The hierarchy: this node's ranks and leader, and the nodes this leader watches.
        order, watched = ring(ctx.nodes, cfg.watch)
        self.nodes = len(order)
        self.node_index = order.index(ctx.node)
        self.node_ranks = [r for r, n in enumerate(ctx.nodes) if n == ctx.node]
        self.leader_rank = self.node_ranks[0]
        self.leader = ctx.rank == self.leader_rank
        self._others = [r for r in self.node_ranks if r != ctx.rank]  # (whose beats a leader reads)
        instance = ctx.store.compare_set("wd/board", "", uuid.uuid4().hex).decode()  # first rank's nonce
        self.board = NodeBoard(ctx.scope + "wd", ctx.node, self.leader, instance)
        self.beats = self.board.beats(self.node_ranks)
        self.act = VerdictActions(
            ctx,
            events,
            self.board,
            cfg,
            beat_of=self._beat_of,
            local=self._local,
            step=lambda: self._step,
            stop=self._stop,
            flush=flush,
        )
        self.leader_judge = RankJudge(ctx.rank, [self.leader_rank], cfg, now)  # (non-leaders: their leader)
        self._local_beats: dict[int, Beat | None] = {}
        self._mine: Beat | None = None  # this rank's beat of this round, as published
        if self.leader:
            first = ctx.leaders()  # each node's lowest rank, in ring order (one pass over the ranks)
            self.watched = watched(ctx.node)
            self.rank_judge = RankJudge(ctx.rank, self.node_ranks, cfg, now)
            self.ring_judge = RingJudge(ctx.rank, {n: first[n] for n in self.watched}, cfg, now)
            self._ring_seen = not self.watched
            self._counted_done = False
            # A store that hangs must not hold the leader past the dead bound (its node watches it).
            with contextlib.suppress(Exception):
                ctx.store.set_timeout(timedelta(seconds=self._store_wait_s))
            # Create if missing: read every round with one multi_get (the news only with a RAM tier).
            for key in (VERDICT, PREEMPT, *([NEWS_KEY] if news is not None else [])):
                ctx.store.compare_set(key, "", "")
            ctx.store.add(DONE, 0)
            ctx.store.add(WAITING, 0)

    # ------------------------------------------------------ training thread
    def start(self) -> None:
        self._publish()
        if self.leader:  # the node's key exists from the start: watchers need not wait for it
            self._set_node_beat()
        self._thread = threading.Thread(target=self._run, name="ftkit-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        """The training loop finished `step` (called from snapshot())."""
        now = time.monotonic()
        interval = now - self._step_started
        busy = (self._first_grad - self._step_started) if self._first_grad else interval
        self._intervals.append(interval)
        self._busy.append(busy)
        self._step, self._step_started, self._first_grad = step, now, None
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            log.warning("ftkit watchdog: the heartbeat thread had died; restarting it")
            self.events.emit("heartbeat_restarted")
            self.start()

    def mark_first_gradient(self) -> None:
        """Under DDP: the first gradient bucket of this step is ready (end of busy time)."""
        if self._first_grad is None:
            self._first_grad = time.monotonic()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The training thread waits inside ftkit (a staging slot, the background work, a
        preemption's final save): heartbeats say so, and the wait is no hang up to `hang_ceiling_s`."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def finish(self) -> None:
        """This rank's loop is over: say so, and keep judging dead and failed ranks until every
        node says so too (a rank that hangs after its peers finished is still caught)."""
        self._finished = True
        with contextlib.suppress(Exception):
            self._publish()
        deadline = time.monotonic() + self.cfg.hang_ceiling_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if self._all_done:
                return
            time.sleep(self.cfg.interval_s / 2)

    def stop(self, failed: bool = False) -> None:
        """Say this rank is done (its silence is not death) and stop. `failed`: its loop raised;
        the verdict is posted at once, so peers do not wait in a collective for it."""
        if self._stopped_once:  # (not `_stop`: an in-process verdict sets it, and the cleanup is still due)
            return
        self._stopped_once = True
        self._stop.set()
        try:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            with contextlib.suppress(Exception):
                self.beats.write(self.ctx.rank, self._beat(done=True, failed=failed, stopped=True))
            # (Store requests bounded here too: a store lost with its host must not hold an ending rank.)
            if failed:
                mine = standing = Verdict(self.ctx.rank, "failed", 0.0, "its training loop raised", self.ctx.rank)
                with contextlib.suppress(Exception):
                    standing = self._store.call(lambda: self.act.post(mine), self._store_wait_s)
                with contextlib.suppress(Exception):
                    self.board.write("verdict.json", standing.to_json())
            if self.leader and not failed:
                with contextlib.suppress(Exception):  # its watchers must not take a finished node for a lost one
                    self._store.call(lambda: self._set_node_beat(done=True), self._store_wait_s)
            if self.leader and self._announced:  # (its node waits no more: the other nodes' clocks run again)
                with contextlib.suppress(Exception):
                    self._store.call(lambda: self.ctx.store.add(WAITING, -1), self._store_wait_s)
            self.board.remove_when_all_stopped(self.node_ranks)  # the last rank of the node out
        finally:
            self._store.close()  # (its thread served this Checkpointer only: a generation's would stay idle)

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        due = time.monotonic()
        while True:
            due += self.cfg.interval_s
            # The node's verdict file every 50 ms (a local read): the node's ranks end at once.
            while (left := due - time.monotonic()) > 0:
                if self._stop.wait(min(left, 0.05)):
                    return
                verdict = Verdict.from_json(self.board.read("verdict.json"))
                if verdict is not None:
                    self.act.join(verdict)
            due = max(due, time.monotonic() - self.cfg.interval_s)  # no burst of rounds after a pause
            try:
                # A failed round must not end the thread: finish() waits on what it counts.
                self._publish()
                if self.leader:
                    self._lead(time.monotonic())
                else:
                    self._follow(time.monotonic())
            except Exception:  # a bug must not silently end failure detection
                log.exception("ftkit watchdog: a heartbeat round failed")

    def _beat(self, done: bool | None = None, failed: bool = False, stopped: bool = False) -> Beat:
        busy, intervals = list(self._busy), list(self._intervals)
        return Beat(
            self._seq,
            self._step,
            statistics.median(busy) if busy else None,
            statistics.median(intervals) if intervals else None,
            os.getpid(),
            self._host_id,
            self._finished if done is None else done,
            failed,
            self._preemption is not None and self._preemption.requested is not None,
            stopped,
            self._start,
            self._waiting > 0 or self._job_waiting,  # (a leader's node hears of the job's through it)
        )

    def _publish(self) -> None:
        """This rank's heartbeat, to its node's board (no store request)."""
        self._seq += 1
        self._mine = beat = self._beat()
        self.beats.write(self.ctx.rank, beat)
        if beat.preempt and not self._told_preempt:  # rare: straight to the store, once
            self._told_preempt = True
            signum = self._preemption.requested if self._preemption is not None else None
            notice = json.dumps(preemption_notice(self.ctx.rank, signum or signal.SIGTERM))
            with contextlib.suppress(Exception):  # (bounded: a lost store must not hold this thread)
                self._store.call(lambda: self.ctx.store.compare_set(PREEMPT, "", notice), self._store_wait_s)

    def _set_node_beat(self, done: bool = False) -> None:
        """The node's heartbeat, to its key in the store (a leader; one request)."""
        self.ctx.store.set(f"wd/node/{self.node_index}", self._node_beat(done).pack())

    def _node_beat(self, done: bool = False) -> NodeBeat:  # (also bench_scale's floor: the same bytes)
        beats = [b for b in self._local_beats.values() if b is not None] + [self._mine or self._beat()]
        return NodeBeat(self._seq, self.ctx.rank, tuple(b.timing for b in beats), done)

    def _exchange(self) -> tuple[dict[int, NodeBeat | None], Verdict | None, tuple[int, int] | None, int]:
        """The leader's round trip with the store: publish the node's heartbeat; read the
        watched nodes' heartbeats, the verdict, a preemption and the finished-node count."""
        ctx = self.ctx
        node_done = self._finished and all(b is not None and b.done for b in self._local_beats.values())
        self._set_node_beat(node_done)
        if node_done and not self._counted_done:
            self._counted_done = True
            ctx.store.add(DONE, 1)
        if self._announce != self._announced:
            ctx.store.add(WAITING, 1 if self._announce else -1)
            self._announced = self._announce
        ring_keys = [f"wd/node/{n}" for n in self.watched]
        if not self._ring_seen:  # until every watched node has published once (a get would wait)
            self._ring_seen = bool(ctx.store.check(ring_keys))
        keys = (ring_keys if self._ring_seen else []) + [WAITING, VERDICT, PREEMPT, DONE]
        # The RAM tier's commit news rides along: no request of its own.
        values = ctx.store.multi_get(keys + ([NEWS_KEY] if self._news is not None else []))
        if self._news is not None:
            self._news.heard(values.pop())
        nodes = {n: NodeBeat.unpack(raw) for n, raw in zip(self.watched, values)} if self._ring_seen else {}
        waiting_raw, verdict_raw, preempt_raw, done_raw = values[-4:]
        self._job_waiting = (rank_key(waiting_raw.decode("ascii", "replace")) or 0) > 0
        verdict = Verdict.from_json(parse_message(verdict_raw))
        peer = parse_preemption_notice(parse_message(preempt_raw))
        done = rank_key(done_raw.decode("ascii", "replace")) or 0  # (a count of ranks, as the store's add writes it)
        return nodes, verdict, peer, done

    def _caught_up(self, now: float, *judges: RankJudge | RingJudge) -> None:
        """A judge that could not look for a while (descheduled, stopped) blames nobody for its own pause."""
        last, self._last_round = self._last_round, now
        if last is not None and now - last > 2 * self.cfg.interval_s:
            for judge in judges:
                judge.freeze(now - last - self.cfg.interval_s)

    def _lead(self, now: float) -> None:
        self._caught_up(now, self.rank_judge, self.ring_judge)
        self._local_beats = self.beats.read(self._others)
        waiting = self._waiting > 0 or any(b is not None and b.waiting for b in self._local_beats.values())
        self._node_wait_since = (self._node_wait_since or now) if waiting else None
        self._announce = waiting and now - (self._node_wait_since or now) >= self.cfg.hang_floor_s / 3
        try:
            nodes, verdict, peer, done = self._store.call(self._exchange, self._store_wait_s)
        except Exception as e:  # the store is unreachable: freeze the clocks, judge nobody
            if self._outage_since is None:
                self._outage_since, self._outage_rounds = now, 0
                log.warning("ftkit watchdog: store unreachable (%s); not judging until it is back", type(e).__name__)
            self._outage_rounds += 1
            lasted = now - self._outage_since
            if lasted >= self.cfg.store_lost_after_s and self._outage_rounds >= 3:
                # Lost with its host (rank 0's agent's): end this node's workers so the agents meet
                # again around a new store (a partitioned host's end the same way).
                why = f"the job's store (served on rank 0's host) has not answered for {lasted:.0f}s"
                self.act.abort(Verdict(0, "dead", lasted, why, self.ctx.rank), post=False)
            return
        if self._outage_since is not None:
            for judge in (self.rank_judge, self.ring_judge):
                judge.freeze(now - self._outage_since)
            self._outage_since = None
        if verdict is not None:
            self.act.join(verdict)
        if peer is not None and not self._heard_preempt:
            self.board.write("preempt.json", preemption_notice(*peer))
            self._hear_preempt(*peer)
        if done >= self.nodes and not self._all_done:
            self.board.write("all-done.json", {"nodes": done})
            self._all_done = True
        verdicts = self.ring_judge.observe(now, nodes)
        mine = self._mine or self._beat()
        local = [b.timing for b in self._local_beats.values() if b is not None]
        sample = local + self.ring_judge.sample() + [mine.timing]
        beats = {**self._local_beats, self.ctx.rank: mine}
        judged = self.rank_judge.observe(
            now, beats, sample, self._gone, self._finished, self._stopped, hold=self._job_waiting
        )
        for rank, busy, median in judged.stragglers:
            self.act.straggler(rank, busy, median)
        self._abort(judged.verdicts + verdicts)

    def _follow(self, now: float) -> None:
        self._caught_up(now, self.leader_judge)  # (the relayed verdict: _run reads it every 50 ms)
        preempt = parse_preemption_notice(self.board.read("preempt.json"))
        if preempt is not None and not self._heard_preempt:
            self._hear_preempt(*preempt)
        if self.board.read("all-done.json") is not None:
            self._all_done = True
        # The leader is this node's aggregator: its own node watches it too.
        beat = self.beats.read_one(self.leader_rank)
        sample = [b.timing for b in (beat, self._mine or self._beat()) if b is not None]
        judged = self.leader_judge.observe(
            now, {self.leader_rank: beat}, sample, self._gone, self._finished, self._stopped
        )
        self._abort(judged.verdicts)  # (its stragglers are its leader's own to report)

    def _abort(self, verdicts: list[Verdict]) -> None:
        for v in verdicts:
            if not (v.why == "its process is gone" and self._said_done(v.target)):  # (finished, exited since)
                self.act.abort(v)

    def _gone(self, beat: Beat) -> bool:
        return self._local(beat) and process_gone(beat.pid)

    def _stopped(self, beat: Beat) -> bool:
        return self._local(beat) and process_stopped(beat.pid)

    def _beat_of(self, rank: int) -> Beat | None:
        """The last heartbeat this rank saw of `rank` (a leader: its node's; another rank: its leader's)."""
        if self.leader:
            return self._local_beats.get(rank)
        return self.leader_judge.clocks[self.leader_rank].beat if rank == self.leader_rank else None

    def _local(self, beat: Beat | None) -> bool:
        """Whether `beat` comes from a process on this host, whose pid we may check and kill."""
        return beat is not None and self._host_id is not None and beat.host_id == self._host_id

    def _said_done(self, rank: int) -> bool:
        beat = self.beats.read_one(rank)
        return beat is not None and beat.done and not beat.failed

    def _hear_preempt(self, rank: int, signum: int) -> None:
        self._heard_preempt = True
        if self._preemption is not None and rank != self.ctx.rank:
            self._preemption.request(signum, by_rank=rank)
