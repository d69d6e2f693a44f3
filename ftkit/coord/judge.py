"""Judging heartbeats, as pure functions of what one node's leader sees (coord/watchdog.py
runs them), so no party reads O(world) heartbeats:

* :class:`RankJudge` – a node leader's judge of its node's ranks (every other rank runs one
  over its leader alone): failed, dead (gone, stopped, or silent), hung (no step progress
  for `hang_factor` x the median step time, clamped), straggler (busy time above
  `straggler_factor` x the others' median). Medians are over the node and its ring.
* :class:`RingJudge` – a leader's judge of the `watch` nodes after its own on the ring.

Time only counts while the judge can see (`freeze(gap)`), a rank is judged only after
its first heartbeat (or `startup_grace_s` of silence), and done ranks are never hung. A
rank whose beat says it waits inside ftkit (a staging slot, a preemption's final save) makes
no step progress on purpose: that time counts toward its hang only past `hang_ceiling_s`.
"""

from __future__ import annotations

import bisect
import math
import statistics
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WatchdogConfig:
    interval_s: float = 0.5
    dead_after_s: float = 3.0
    stopped_after_s: float = 1.0  # a rank on this host whose process is stopped (state T) and silent this long is dead
    hang_factor: float = 10.0
    hang_floor_s: float = 30.0
    hang_ceiling_s: float = 1800.0
    straggler_factor: float = 2.0
    straggler_min_excess_s: float = 0.05  # and at least a quarter of a step: noise is not a straggler
    straggler_checks: int = 6
    straggler_action: str = "log"  # or "abort"
    flush_deadline_s: float = 10.0
    startup_grace_s: float = 120.0  # a rank (or node) never seen for this long is dead
    watch: int = 2  # nodes each node's leader watches on the ring
    recovery_timeout_s: float = 30.0  # under run_in_process: a verdict not followed by a recovery ends the worker
    # A leader whose every store request failed this long (and 3 rounds) takes the store for lost
    # with its host and ends its node's workers, so the agents meet again around a new store.
    store_lost_after_s: float = 10.0


Timing = tuple[float | None, float | None]  # one rank's (busy, interval): what the medians are taken over


def _num(v: Any, lo: float = 0.0, hi: float = 1e9) -> float | None:
    """A finite number in [lo, hi] from untrusted JSON, else None (a bool is not a number)."""
    t = type(v)
    return float(v) if (t is float or t is int) and lo <= v <= hi else None


def _int(v: Any, lo: int = -1, hi: int = 2**62) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else None


@dataclass(slots=True)
class Beat:
    """One rank's heartbeat, as its leader read it (coord/beatslots.py). Not frozen: a leader
    builds one per rank every interval, and a frozen dataclass's __init__ is much slower."""

    seq: int
    step: int | None = None
    busy: float | None = None  # median busy time per step (to the first gradient under DDP)
    interval: float | None = None  # median step time
    pid: int | None = None
    host_id: str | None = None
    done: bool = False
    failed: bool = False
    preempt: bool = False
    stopped: bool = False  # its watchdog has stopped: the rank's last beat
    # When its process started (runtime/warm/client.py process_start): with `pid`, which process
    # a verdict may kill (a pid reused since is another's). None: not recorded.
    start: int | None = None
    waiting: bool = False  # its training thread waits inside ftkit (Watchdog.waiting)

    @property
    def timing(self) -> Timing:
        return (self.busy, self.interval)


@dataclass(frozen=True)
class Verdict:
    target: int  # the rank judged
    what: str  # failed, dead, hung, straggler
    latency_s: float  # how long it had been so when judged
    why: str
    by: int = -1  # the rank that judged
    # The judge is on the target's host and the target is (or will be) a process gone: a warm
    # client can replace it (ftkit run --replace-dead).
    local: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @staticmethod
    def from_json(doc: Any) -> Verdict | None:
        if not isinstance(doc, dict) or doc.get("what") not in ("failed", "dead", "hung", "straggler"):
            return None
        target, by, latency = _int(doc.get("target"), 0), _int(doc.get("by"), -1), _num(doc.get("latency_s"))
        why = doc.get("why")
        if target is None or by is None or latency is None or not isinstance(why, str):
            return None
        return Verdict(target, doc["what"], latency, why[:300], by, doc.get("local") is True)


@dataclass
class _Clock:
    seq: int = -1
    step: int = -1
    changed: float = 0.0  # when the heartbeat counter last moved
    step_changed: float = 0.0
    slow_checks: int = 0
    flagged: bool = False  # reported as a straggler (until it recovers)
    beat: Beat | None = None
    seen_at: float = 0.0  # when the judge last looked
    held: float = 0.0  # time not counted toward a hang since the step changed (its waits inside ftkit)

    def see(self, beat: Beat | None, now: float, hold_limit: float = math.inf, hold: bool = False) -> None:
        if self.beat is not None and (hold or self.beat.waiting) and self.held < hold_limit:
            gap = now - self.seen_at  # waiting inside ftkit since the last look: not a hang
            self.step_changed += gap
            self.held += gap
        self.seen_at = now
        if beat is None or beat.seq == self.seq:
            return
        first = self.seq < 0
        self.seq, self.changed, self.beat = beat.seq, now, beat
        step = beat.step if beat.step is not None else -1
        if first or step != self.step:
            self.step, self.step_changed, self.held = step, now, 0.0


@dataclass
class Judgement:
    verdicts: list[Verdict] = field(default_factory=list)
    stragglers: list[tuple[int, float, float]] = field(default_factory=list)  # (rank, busy, median busy)


class _Judge:
    """A clock per party judged (a rank, or a watched node), from `now` on."""

    def __init__(self, me: int, parties: Iterable[int], cfg: WatchdogConfig, now: float):
        self.me, self.cfg, self.started = me, cfg, now
        self.clocks = {p: _Clock() for p in parties}

    def freeze(self, gap: float) -> None:
        """Nothing could be seen for `gap` seconds: nobody's clock ran."""
        for c in self.clocks.values():
            c.changed += gap
            c.step_changed += gap


class RankJudge(_Judge):
    """A node leader's judge of its node's ranks (module docstring); `me`, the leader, only
    as a straggler (its death or hang is its node's and its ring watchers' to see)."""

    def observe(
        self,
        now: float,
        beats: Mapping[int, Beat | None],
        sample: Iterable[Timing],
        gone: Callable[[Beat], bool],
        finished: bool = False,
        stopped: Callable[[Beat], bool] | None = None,
        hold: bool = False,
    ) -> Judgement:
        """Judge the node's ranks from their `beats` (None: none readable). `sample`: the timings
        the medians are taken over; `gone(beat)` / `stopped(beat)`: whether that rank's process
        has exited / is stopped (on its host only); `finished`: no more hung or straggler verdicts;
        `hold`: a rank of the job waits inside ftkit, so no step clock runs (up to the ceiling)."""
        cfg, out = self.cfg, Judgement()
        sample = list(sample)
        intervals = [interval for _, interval in sample if interval]
        median_step = statistics.median(intervals) if intervals else None
        bound = min(max(cfg.hang_factor * (median_step or 0.0), cfg.hang_floor_s), cfg.hang_ceiling_s)
        busies = sorted(busy for busy, _ in sample if busy)
        for r, clock in self.clocks.items():
            beat = beats.get(r)
            clock.see(beat, now, cfg.hang_ceiling_s, hold)
            seen = clock.beat
            if r == self.me:  # a leader cannot see itself die or hang, but can see itself lag
                if seen is not None and not seen.done:
                    self._check_straggler(r, clock, seen, finished, busies, median_step, out)
                continue
            if seen is not None and seen.done:
                if seen.failed:
                    out.verdicts.append(Verdict(r, "failed", 0.0, "its training loop raised", self.me))
                continue
            if clock.seq < 0:
                if now - self.started > cfg.startup_grace_s:
                    out.verdicts.append(Verdict(r, "dead", now - self.started, "never sent a heartbeat", self.me))
                continue
            assert seen is not None
            silent = now - clock.changed
            if gone(seen):
                out.verdicts.append(Verdict(r, "dead", silent, "its process is gone", self.me, True))
            elif stopped is not None and silent > cfg.stopped_after_s and stopped(seen):
                why = f"its process is stopped, no heartbeat for {silent:.1f}s"
                out.verdicts.append(Verdict(r, "dead", silent, why, self.me, True))
            elif silent > cfg.dead_after_s:
                out.verdicts.append(Verdict(r, "dead", silent, f"no heartbeat for {silent:.1f}s", self.me))
            elif clock.step >= 0 and now - clock.step_changed > bound and not finished:
                still = now - clock.step_changed
                why = f"no step progress for {still:.1f}s (bound {bound:.0f}s)"
                out.verdicts.append(Verdict(r, "hung", still, why, self.me))  # (the watchdog says if local)
            self._check_straggler(r, clock, seen, finished, busies, median_step, out)
        return out

    def _check_straggler(self, r, clock, seen, finished, busies: list[float], median_step, out: Judgement) -> None:
        """A straggler's busy time stays above `straggler_factor` x the median of the *other*
        ranks' (with itself in the median, one slow rank of two could never be twice it)."""
        cfg, busy = self.cfg, seen.busy
        median_busy = _median_without(busies, busy)
        min_excess = max(cfg.straggler_min_excess_s, 0.25 * (median_step or 0))
        if (
            not finished
            and median_busy
            and busy
            and busy > cfg.straggler_factor * median_busy
            and busy - median_busy > min_excess
        ):
            clock.slow_checks += 1
            if clock.slow_checks >= cfg.straggler_checks and not clock.flagged:
                clock.flagged = True
                out.stragglers.append((r, busy, median_busy))
        else:
            clock.slow_checks, clock.flagged = 0, False


def _median_without(ordered: list[float], value: float | None) -> float | None:
    """The median of `ordered` (sorted) less one occurrence of `value`; None if nothing is
    left. By index, without copying: it runs for every rank every interval."""
    n = len(ordered)
    i = bisect.bisect_left(ordered, value) if value else n
    if not (i < n and ordered[i] == value):
        return statistics.median(ordered) if ordered else None
    m = n - 1  # the others: ordered[k] for k < i, ordered[k + 1] after
    if m == 0:
        return None

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


@dataclass(frozen=True)
class NodeBeat:
    """One node's aggregated heartbeat, published by its leader: one store key per node. Only
    its ranks' timings (for the watchers' medians): their liveness is judged on the node."""

    seq: int
    leader: int
    timings: tuple[Timing, ...]  # its ranks' (busy, interval), from their latest beats
    done: bool = False  # every rank of the node has finished

    def pack(self) -> bytes:
        """The store value: a fixed head, then each rank's (busy, interval) as two doubles
        (NaN: unknown). Packed, not JSON: every leader decodes two per interval."""
        flat = [math.nan if v is None else v for t in self.timings for v in t]
        head = _NODE_HEAD.pack(_NODE_MAGIC, self.seq, self.leader, self.done, len(self.timings))
        return head + struct.pack(f"<{len(flat)}d", *flat)

    @staticmethod
    def unpack(raw: bytes, max_ranks: int = 4096) -> NodeBeat | None:
        """The node's beat, or None for anything malformed; a number out of range is unknown."""
        if len(raw) < _NODE_HEAD.size:
            return None
        magic, seq, leader, done, count = _NODE_HEAD.unpack_from(raw)
        if magic != _NODE_MAGIC or count > max_ranks or len(raw) != _NODE_HEAD.size + 16 * count:
            return None
        if not (0 <= seq <= 2**62 and 0 <= leader <= 2**62):
            return None
        flat = [v if 0.0 <= v <= 1e9 else None for v in struct.unpack_from(f"<{2 * count}d", raw, _NODE_HEAD.size)]
        return NodeBeat(seq, leader, tuple(zip(flat[::2], flat[1::2])), done == 1)


_NODE_MAGIC = b"ftn1"
_NODE_HEAD = struct.Struct("<4sqqBH")  # magic, seq, leader, done, how many ranks' timings


class RingJudge(_Judge):
    """A leader's judge of the nodes it watches on the ring (module docstring)."""

    def __init__(self, me: int, leaders: Mapping[int, int], cfg: WatchdogConfig, now: float):
        """`leaders`: watched node index -> that node's leader rank."""
        super().__init__(me, leaders, cfg, now)
        self.leaders = dict(leaders)
        self.latest: dict[int, NodeBeat] = {}

    def observe(self, now: float, nodes: Mapping[int, NodeBeat | None]) -> list[Verdict]:
        out = []
        for n, clock in self.clocks.items():
            nb = nodes.get(n)
            if nb is not None:
                self.latest[n] = nb
                if nb.seq != clock.seq:
                    clock.seq, clock.changed = nb.seq, now
            latest = self.latest.get(n)
            if latest is not None and latest.done:
                continue
            leader = self.leaders[n]
            if clock.seq < 0:
                if now - self.started > self.cfg.startup_grace_s:
                    why = f"node {n} never published a heartbeat"
                    out.append(Verdict(leader, "dead", now - self.started, why, self.me))
                continue
            silent = now - clock.changed
            if silent > self.cfg.dead_after_s:
                why = (
                    f"node {n}'s heartbeat stopped for {silent:.1f}s (its leader, the aggregator, or the node is lost)"
                )
                out.append(Verdict(leader, "dead", silent, why, self.me))
        return out

    def sample(self) -> list[Timing]:
        """The watched nodes' ranks' latest timings (for the medians)."""
        return [t for nb in self.latest.values() for t in nb.timings]


def ring(nodes: list[str], watch: int = 2) -> tuple[list[str], Callable[[str], list[int]]]:
    """The nodes in ring order (first appearance by rank) and, per node, the indexes of
    the `watch` nodes after it (fewer when there are fewer other nodes)."""
    order = list(dict.fromkeys(nodes))
    count = len(order)

    def watched(node: str) -> list[int]:
        i = order.index(node)
        return [(i + j) % count for j in range(1, min(watch, count - 1) + 1)]

    return order, watched
