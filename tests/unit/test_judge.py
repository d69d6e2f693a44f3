"""The watchdog's judges (coord/judge.py) at 1,024 simulated ranks, without processes.

128 nodes of 8 ranks: every node's leader runs a RankJudge over its node's beats
and a RingJudge over the aggregated beats of the 2 nodes after it; every other
rank runs a LeaderJudge over its leader's beat. Time is simulated (0.5 s rounds);
the faults are what the beats would show.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ftkit.coord.judge import Beat, NodeBeat, RankJudge, RingJudge, Verdict, WatchdogConfig, ring

NODES, PER = 128, 8
WORLD = NODES * PER
CFG = WatchdogConfig()
STEP_S = 0.1  # every rank's step time (so the hang bound is its floor, 30 s)


class Cluster:
    def __init__(self):
        self.names = [f"n{r // PER}" for r in range(WORLD)]
        order, watched = ring(self.names, CFG.watch)
        self.watched = {n: watched(order[n]) for n in range(NODES)}
        self.t = 0.0
        self.rank_judges = {n: RankJudge(n * PER, range(n * PER, (n + 1) * PER), CFG, 0.0) for n in range(NODES)}
        self.ring_judges = {
            n: RingJudge(n * PER, {m: m * PER for m in self.watched[n]}, CFG, 0.0) for n in range(NODES)
        }
        self.leader_judges = {r: RankJudge(r, [r // PER * PER], CFG, 0.0) for r in range(WORLD) if r % PER}
        self.seq = [0] * WORLD
        self.step = [0] * WORLD
        self.silent: set[int] = set()  # ranks whose heartbeat stopped
        self.stuck: set[int] = set()  # ranks whose step stopped (heartbeats go on)
        self.waiting: set[int] = set()  # ranks whose beats say they wait inside ftkit
        self.gone: set[int] = set()  # ranks whose process exited
        self.stopped: set[int] = set()  # ranks whose process is stopped (SIGSTOP): silent too
        self.unpublished: set[int] = set()  # nodes whose aggregate no longer reaches the store
        self.busy = dict.fromkeys(range(WORLD), 0.05)
        self.node_beats: dict[int, NodeBeat] = {}
        self.verdicts: list[Verdict] = []
        self.stragglers: list[tuple[int, float, float]] = []

    def beat(self, r: int) -> Beat:
        return Beat(
            self.seq[r], self.step[r], self.busy[r], STEP_S, pid=1000 + r, host_id="h", waiting=r in self.waiting
        )

    def round(self, store_up: bool = True) -> None:
        self.t += CFG.interval_s
        for r in range(WORLD):
            if r not in self.silent and r not in self.gone and r not in self.stopped:
                self.seq[r] += 1
                if r not in self.stuck:
                    self.step[r] += 5
        beats = {r: self.beat(r) for r in range(WORLD)}
        for n in range(NODES):
            leader = n * PER
            if leader in self.silent or leader in self.gone or leader in self.stopped:
                continue
            if store_up and n not in self.unpublished:
                ranks = range(n * PER, (n + 1) * PER)
                self.node_beats[n] = NodeBeat(self.seq[leader], leader, tuple(beats[r].timing for r in ranks))
        for n in range(NODES):
            leader = n * PER
            if leader in self.silent or leader in self.gone or leader in self.stopped:
                continue
            if not store_up:  # the leader judges nobody while it cannot reach the store
                continue
            ring_j, rank_j = self.ring_judges[n], self.rank_judges[n]
            self.verdicts += ring_j.observe(self.t, {m: self.node_beats.get(m) for m in self.watched[n]})
            local = {r: beats[r] for r in range(n * PER, (n + 1) * PER)}
            sample = [b.timing for b in local.values()] + ring_j.sample()
            judged = rank_j.observe(self.t, local, sample, self.is_gone, stopped=self.is_stopped)
            self.verdicts += judged.verdicts
            self.stragglers += judged.stragglers
        for r, judge in self.leader_judges.items():
            if r in self.silent or r in self.gone or r in self.stopped:
                continue
            leader = r // PER * PER
            sample = [beats[leader].timing, beats[r].timing]
            judged = judge.observe(self.t, {leader: beats[leader]}, sample, self.is_gone, stopped=self.is_stopped)
            self.verdicts += judged.verdicts

    def is_gone(self, b: Beat) -> bool:
        return b.pid - 1000 in self.gone  # type: ignore[operator]

    def is_stopped(self, b: Beat) -> bool:
        return b.pid - 1000 in self.stopped  # type: ignore[operator]

    def run(self, seconds: float, **kw) -> None:
        for _ in range(int(seconds / CFG.interval_s)):
            self.round(**kw)

    def first(self, target: int) -> Verdict:
        return min((v for v in self.verdicts if v.target == target), key=lambda v: v.latency_s)


@pytest.fixture
def cluster() -> Cluster:
    c = Cluster()
    c.run(5)  # every rank and node seen, medians formed
    return c


def test_the_ring_watches_every_node_twice_and_no_node_itself():
    names = [f"n{r // PER}" for r in range(WORLD)]
    order, watched = ring(names, 2)
    counts = Counter(m for n in order for m in watched(n))
    assert len(order) == NODES and set(counts.values()) == {2}
    assert all(order.index(n) not in watched(n) for n in order)
    assert ring(["a", "a", "b"], 2)[1]("a") == [1]  # two nodes: each watches the other


def test_a_quiet_two_minutes_gives_no_verdict_and_no_straggler(cluster):
    cluster.run(120)
    assert cluster.verdicts == [] and cluster.stragglers == []


def test_a_silent_rank_is_dead_after_the_bound_and_judged_only_by_its_leader(cluster):
    cluster.silent.add(77)
    cluster.run(CFG.dead_after_s + 1)
    assert {(v.target, v.what, v.by) for v in cluster.verdicts} == {(77, "dead", 72)}
    assert CFG.dead_after_s < cluster.first(77).latency_s <= CFG.dead_after_s + CFG.interval_s


def test_a_gone_process_is_dead_at_the_next_round(cluster):
    cluster.gone.add(300)
    cluster.round()
    assert [(v.target, v.what, v.why) for v in cluster.verdicts] == [(300, "dead", "its process is gone")]


@pytest.mark.parametrize("rank", [513, 512])  # a rank, and a leader (its own node's ranks see it)
def test_a_stopped_process_is_dead_once_silent_for_its_shorter_bound(cluster, rank):
    # SIGSTOP, job control, a debugger: the process state says it cannot progress (a hang that
    # leaves the process running is the hung or dead bound's, as before)
    cluster.stopped.add(rank)
    cluster.run(CFG.stopped_after_s + CFG.interval_s)
    assert {(v.target, v.what) for v in cluster.verdicts} == {(rank, "dead")}
    assert all("its process is stopped" in v.why for v in cluster.verdicts)
    assert CFG.stopped_after_s < cluster.first(rank).latency_s <= CFG.stopped_after_s + CFG.interval_s


def test_a_process_stopped_and_continued_within_its_bound_is_not_judged(cluster):
    for _ in range(4):  # stopped for 1 s, running for 0.5 s, over and over (a throttled rank)
        cluster.stopped.add(513)
        cluster.run(CFG.stopped_after_s)
        cluster.stopped.discard(513)
        cluster.run(CFG.interval_s)
    assert cluster.verdicts == []


@pytest.mark.parametrize("rank", [513, 512])  # a rank, and a leader (its own node sees it hang)
def test_a_hung_rank_is_found_within_its_bound(cluster, rank):
    cluster.stuck.add(rank)
    cluster.run(29)
    assert cluster.verdicts == []
    cluster.run(2)
    assert {(v.target, v.what) for v in cluster.verdicts} == {(rank, "hung")}
    assert 30 < cluster.first(rank).latency_s <= 31


@pytest.mark.parametrize("rank", [513, 512])
def test_a_rank_waiting_inside_ftkit_is_no_hang_until_the_ceiling_and_its_step_clock_resumes_after(cluster, rank):
    # a staging slot, a preemption's final save: no step progress on purpose, for minutes
    cluster.stuck.add(rank)
    cluster.waiting.add(rank)
    cluster.run(120)
    assert cluster.verdicts == []
    cluster.waiting.discard(rank)  # the wait is over but the step still does not move: time counts again
    cluster.run(29)
    assert cluster.verdicts == []
    cluster.run(2)
    assert {(v.target, v.what) for v in cluster.verdicts} == {(rank, "hung")}


def test_a_wait_inside_ftkit_that_never_ends_is_a_hang_past_the_ceiling():
    cfg = WatchdogConfig(hang_ceiling_s=100.0)
    judge, verdicts = RankJudge(0, [0, 1], cfg, 0.0), []
    for i in range(1, 300):  # rank 1 steps for 5 s, then waits inside ftkit for good
        now = i * cfg.interval_s
        beat = Beat(i, min(i, 10), 0.05, STEP_S, pid=1001, host_id="h", waiting=i > 10)
        judged = judge.observe(now, {0: None, 1: beat}, [beat.timing], lambda b: False)
        verdicts += [(round(now), v.what) for v in judged.verdicts if v.target == 1]
    # hung once the wait passed the ceiling, and the hang bound (30 s) after that
    assert verdicts and verdicts[0][1] == "hung" and 5 + 100 + 30 <= verdicts[0][0] <= 5 + 100 + 31


def test_a_dead_aggregator_is_found_by_its_ring_watchers_and_its_own_node(cluster):
    cluster.silent.add(5 * PER)  # node 5's leader
    cluster.run(CFG.dead_after_s + 1)
    by = {v.by for v in cluster.verdicts if v.target == 5 * PER and v.what == "dead"}
    watchers = {n * PER for n in range(NODES) if 5 in cluster.watched[n]}
    assert watchers == {3 * PER, 4 * PER}
    assert by == watchers | set(range(5 * PER + 1, 6 * PER))  # its ring watchers and its own ranks
    assert {v.target for v in cluster.verdicts} == {5 * PER}


def test_a_partitioned_node_is_lost_to_the_ring_and_nobody_else_is_blamed(cluster):
    cluster.unpublished.add(90)  # its processes run, its aggregate no longer reaches the store
    cluster.run(CFG.dead_after_s + 1)
    assert {(v.target, v.what) for v in cluster.verdicts} == {(90 * PER, "dead")}
    assert {v.by for v in cluster.verdicts} == {88 * PER, 89 * PER}


def test_a_store_outage_longer_than_the_dead_bound_kills_nobody(cluster):
    gap = 3 * CFG.dead_after_s
    cluster.run(gap, store_up=False)
    for n in range(NODES):  # what a leader does when the store is back
        cluster.rank_judges[n].freeze(gap)
        cluster.ring_judges[n].freeze(gap)
    cluster.run(10)
    assert cluster.verdicts == []


@pytest.mark.parametrize("rank", [1001, 1000])  # a rank, and a leader (it reports itself)
def test_a_straggler_is_reported_once_by_its_leader(cluster, rank):
    cluster.busy[rank] = 0.25  # 5x the others
    cluster.run(20)
    assert [(r, busy) for r, busy, _median in cluster.stragglers] == [(rank, 0.25)]
    assert cluster.verdicts == []


def test_one_slow_rank_of_two_is_a_straggler():
    # The median is the other ranks': with itself in it, one slow rank of two (a 2-rank job, or
    # a node of 2 judging itself alone) could never be twice the median.
    judge = RankJudge(0, [0, 1], CFG, 0.0)
    stragglers = []
    for i in range(1, 30):
        beats = {0: Beat(i, i, 0.05, 0.3, pid=1, host_id="h"), 1: Beat(i, i, 0.25, 0.3, pid=2, host_id="h")}
        judged = judge.observe(i * CFG.interval_s, beats, [b.timing for b in beats.values()], lambda b: False)
        assert judged.verdicts == []
        stragglers += judged.stragglers
    assert stragglers == [(1, 0.25, 0.05)]


def test_malformed_beats_are_silence_not_crashes():
    # (A rank's beat is checked where it is decoded: tests/unit/test_beatslots.py.)
    node = NodeBeat(4, 8, ((0.05, 0.3), (None, 0.3)), done=True)
    assert NodeBeat.unpack(node.pack()) == node
    # A number out of its range is an unknown timing; a bad frame is no node beat at all.
    weird = NodeBeat(1, 0, ((0.1, float("nan")), (float("inf"), 0.2), (-1.0, 2e9)))
    assert NodeBeat.unpack(weird.pack()) == NodeBeat(1, 0, ((0.1, None), (None, 0.2), (None, None)))
    raw = node.pack()
    for bad in (b"", raw[:-1], raw + b"\0", b"ftn2" + raw[4:], b'{"seq": 4, "leader": 8, "timings": []}'):
        assert NodeBeat.unpack(bad) is None
    assert NodeBeat.unpack(NodeBeat(-1 % 2**63, 0, ()).pack()) is None  # a seq past its range
    assert NodeBeat.unpack(NodeBeat(1, 0, ((0.1, 0.1),) * 5000).pack()) is None  # more ranks than a node has
    assert Verdict.from_json({"target": 1, "what": "exploded", "latency_s": 0, "why": "", "by": 0}) is None
    judge = RankJudge(0, range(4), CFG, 0.0)
    assert judge.observe(1.0, {1: None, 2: None, 3: None}, [], lambda b: False).verdicts == []
