"""Heartbeats and failure detection: dead, hung and straggling ranks.

Each rank runs one daemon thread that, every `interval_s`,

1. publishes its heartbeat to the c10d store: a counter, the current step and
   recent step timings (handed over by the training thread through
   :meth:`Watchdog.progress`), host and pid;
2. reads every rank's heartbeat and judges them. Every rank judges every other,
   so detection does not depend on any one rank staying healthy:

   * failed: its training loop raised, and its Checkpointer said so on the way
     out (seen within one interval);
   * dead: its process on this host is gone (seen within one interval), or its
     heartbeat counter has not moved for `dead_after_s` (a SIGSTOPped process,
     a lost node);
   * hung: heartbeats move but its step has not, for longer than
     `hang_factor` x the median step time, clamped to [`hang_floor_s`,
     `hang_ceiling_s`], so nobody hand-tunes a timeout per model;
   * straggler: its busy time per step (up to its first gradient all-reduce under
     DDP, else the whole step; the median of its last 10 steps) stays above
     `straggler_factor` x the median of all ranks, and above it by a quarter of a step (`straggler_min_excess_s` at
     least), for `straggler_checks` checks in a row: reported, and an abort only
     if `straggler_action="abort"`.

On a failed, dead or hung rank the thread records the event, kills that process if it
is on this host (a stopped process would otherwise hold up torchrun's restart;
"this host" means the same host name, boot id and pid namespace, see
dist.host_identity: a pid from another container with the same host name names
an unrelated process here),
and ends this process (on a straggler abort, background persists first get
`flush_deadline_s` to finish: the straggler can still contribute its share) with
`os._exit` (``sys.exit`` in a thread only ends the thread), so
torchrun's elastic agent restarts the worker group and survivors never sit in a
collective until its timeout.

False alarms are avoided: time only counts while this rank can read the store
(an outage freezes every clock), a rank is judged only after its first
heartbeat, finished ranks say so (and keep watching until every rank has
finished: a rank that hangs after its peers are done is still caught), and a
heartbeat thread that died is restarted by the next progress() call on the
training thread.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.coord.dist import DistContext, host_identity
from ftkit.coord.events import EventLog

log = logging.getLogger("ftkit")

EXIT_CODE = 75  # what an aborting rank exits with (EX_TEMPFAIL: try again)


@dataclass(frozen=True)
class WatchdogConfig:
    interval_s: float = 0.5
    dead_after_s: float = 3.0
    hang_factor: float = 10.0
    hang_floor_s: float = 30.0
    hang_ceiling_s: float = 1800.0
    straggler_factor: float = 2.0
    straggler_min_excess_s: float = 0.05  # and at least a quarter of a step: noise is not a straggler
    straggler_checks: int = 6
    straggler_action: str = "log"  # or "abort"
    flush_deadline_s: float = 10.0
    startup_grace_s: float = 120.0  # a rank never seen for this long is dead


def _process_gone(pid: Any) -> bool:
    """A process on this host has exited (or is a zombie waiting for torchrun to reap it).

    Seeing it is faster than `dead_after_s` of silence: torchrun's own restart
    waits for this rank to stop, and this rank may be stuck in a collective."""
    if not pid:
        return False
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False


@dataclass
class _Seen:
    seq: int = -1
    step: int = -1
    changed: float = 0.0  # monotonic time the counter last moved
    step_changed: float = 0.0
    slow_checks: int = 0
    flagged_straggler: bool = False
    info: dict | None = None
    info_failed: bool = False


class Watchdog:
    def __init__(
        self,
        ctx: DistContext,
        events: EventLog,
        config: WatchdogConfig | None = None,
        flush: Callable[[float], None] | None = None,
        preempted: Callable[[], bool] | None = None,
        on_peer_preempted: Callable[[int], None] | None = None,
    ):
        self.ctx = ctx
        self.events = events
        self.cfg = config or WatchdogConfig()
        self._flush = flush
        self._preempted = preempted  # did this rank get a preemption signal? (told to peers)
        self._on_peer_preempted = on_peer_preempted
        self._step: int | None = None  # None until the first step ends: no hang clock before it
        # The busy time a straggler verdict uses: the median of the last 10 steps turns once
        # 6 of them are slow (with 20 it took 11: ~7 s for a rank at a tenth of its speed here).
        self._busy: deque[float] = deque(maxlen=10)
        self._intervals: deque[float] = deque(maxlen=20)
        self._step_started = time.monotonic()
        self._first_grad: float | None = None
        self._seq = 0
        self._seen = {r: _Seen() for r in range(ctx.world_size) if r != ctx.rank}
        self._host_id = host_identity()  # whose pids we may look up and kill (None: nobody's)
        self._finished = False  # finish() was called: heartbeats say "done"
        self._stop = threading.Event()
        self._outage_since: float | None = None
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None
        self.detections: list[dict[str, Any]] = []

    # ------------------------------------------------------ training thread
    def start(self) -> None:
        self._publish()
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

    def finish(self) -> None:
        """This rank's loop is over: say so, and keep judging the others until they say so too.

        A rank that hangs after its peers finished would otherwise go unnoticed:
        torchrun waits for every worker, and nobody would be watching it. Only
        dead and failed ranks are judged now (a silent heartbeat, a gone
        process): a peer may spend a while on its own ending without steps.
        """
        self._finished = True
        deadline = time.monotonic() + self.cfg.hang_ceiling_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if all(s.info and s.info.get("done") for s in self._seen.values()):
                return
            time.sleep(self.cfg.interval_s / 2)

    def stop(self, failed: bool = False) -> None:
        """Say this rank is done (so peers do not take its silence for death) and stop.

        `failed`: its training loop raised. Peers then end at once rather than
        wait in a collective for a rank that will never join it.
        """
        if self._stop.is_set() and not failed:
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            self.ctx.put(
                f"hb/{self.ctx.rank}",
                {
                    "done": True,
                    "failed": failed,
                    "host": socket.gethostname(),
                    "host_id": self._host_id,
                    "pid": os.getpid(),
                },
            )
        except Exception:
            pass

    # ---------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self._publish()
                beats = self._read()
            except Exception as e:  # store unreachable: freeze the clocks, judge nobody
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning(
                        "ftkit watchdog: store unreachable (%s); not judging peers until it is back", type(e).__name__
                    )
                continue
            if self._outage_since is not None:
                gap = time.monotonic() - self._outage_since
                for s in self._seen.values():
                    s.changed += gap
                    s.step_changed += gap
                self._outage_since = None
            try:
                self._judge(beats)
            except Exception:
                log.exception("ftkit watchdog: judging heartbeats failed")

    def _publish(self) -> None:
        self._seq += 1
        busy = list(self._busy)
        self.ctx.put(
            f"hb/{self.ctx.rank}",
            {
                "seq": self._seq,
                "step": self._step,
                "host": socket.gethostname(),
                "host_id": self._host_id,
                "pid": os.getpid(),
                "busy": statistics.median(busy) if busy else None,
                "interval": statistics.median(self._intervals) if self._intervals else None,
                "preempt": bool(self._preempted and self._preempted()),
                **({"done": True} if self._finished else {}),
            },
        )

    def _read(self) -> dict[int, dict]:
        out = {}
        for r in self._seen:
            key = f"hb/{r}"
            if self.ctx.store.check([key]):
                out[r] = self.ctx.get(key, timeout_s=5)
        return out

    def _local(self, beat: dict) -> bool:
        """Whether `beat` comes from a process on this host, whose pid we may check and kill."""
        return self._host_id is not None and beat.get("host_id") == self._host_id

    def _said_done(self, rank: int) -> bool:
        try:
            beat = self.ctx.get(f"hb/{rank}", timeout_s=5)
        except Exception:
            return False
        if beat.get("done"):
            self._seen[rank].info = beat
        return bool(beat.get("done"))

    def _judge(self, beats: dict[int, dict]) -> None:
        now = time.monotonic()
        cfg = self.cfg
        intervals = [b["interval"] for b in beats.values() if b.get("interval")] + (
            [statistics.median(self._intervals)] if self._intervals else []
        )
        median_step = statistics.median(intervals) if intervals else None
        hang_bound = min(max(cfg.hang_factor * (median_step or 0), cfg.hang_floor_s), cfg.hang_ceiling_s)
        busies = {r: b["busy"] for r, b in beats.items() if b.get("busy")}
        if self._busy:
            busies[self.ctx.rank] = statistics.median(self._busy)
        median_busy = statistics.median(busies.values()) if len(busies) >= 2 else None
        for r, seen in self._seen.items():
            beat = beats.get(r)
            if beat is not None and beat.get("done"):
                if beat.get("failed") and not seen.info_failed:
                    seen.info_failed = True
                    self._abort(r, "failed", 0.0, "its training loop raised")
                verdict = beat.get("aborted")
                if verdict and verdict["target"] != self.ctx.rank:  # join it: the group restarts anyway
                    self._abort(verdict["target"], verdict["what"], 0.0, f"rank {r} found it {verdict['what']}")
                seen.info = beat
                continue
            if beat is not None and beat.get("preempt") and self._on_peer_preempted is not None:
                self._on_peer_preempted(r)
            if beat is not None and beat["seq"] != seen.seq:
                first = seen.seq < 0
                seen.seq, seen.changed, seen.info = beat["seq"], now, beat
                step = beat["step"] if beat["step"] is not None else -1
                if first or step != seen.step:
                    seen.step, seen.step_changed = step, now
            if seen.seq < 0:
                if now - self._started > cfg.startup_grace_s:
                    self._abort(r, "dead", now - self._started, "never sent a heartbeat")
                continue
            if seen.info and self._local(seen.info) and _process_gone(seen.info.get("pid")):
                if self._said_done(r):  # it finished and exited after this round's read
                    continue
                self._abort(r, "dead", now - seen.changed, "its process is gone")
            elif now - seen.changed > cfg.dead_after_s:
                self._abort(r, "dead", now - seen.changed, f"no heartbeat for {now - seen.changed:.1f}s")
            elif seen.step >= 0 and now - seen.step_changed > hang_bound and not self._finished:
                # (only after its first step; and not once this rank is done: a peer may still be
                # busy with its own ending, e.g. an evaluation, without steps)
                self._abort(
                    r,
                    "hung",
                    now - seen.step_changed,
                    f"no step progress for {now - seen.step_changed:.1f}s (bound {hang_bound:.0f}s)",
                )
            busy = busies.get(r)
            min_excess = max(cfg.straggler_min_excess_s, 0.25 * (median_step or 0))
            if (
                not self._finished
                and median_busy
                and busy
                and busy > cfg.straggler_factor * median_busy
                and busy - median_busy > min_excess
            ):
                seen.slow_checks += 1
                if seen.slow_checks >= cfg.straggler_checks and not seen.flagged_straggler:
                    seen.flagged_straggler = True
                    self._straggler(r, busy, median_busy)
            else:
                seen.slow_checks = 0
                seen.flagged_straggler = False

    # -------------------------------------------------------------- actions
    def _straggler(self, rank: int, busy: float, median: float) -> None:
        log.warning("ftkit watchdog: rank %d is a straggler: %.3fs per step busy vs median %.3fs", rank, busy, median)
        self.events.emit("straggler", target=rank, busy_s=busy, median_s=median, factor=busy / median, by=self.ctx.rank)
        self.detections.append({"target": rank, "what": "straggler"})
        if self.cfg.straggler_action == "abort":
            self._abort(rank, "straggler", 0.0, f"{busy / median:.1f}x slower than the median")

    def _abort(self, rank: int, what: str, latency: float, why: str) -> None:
        info = self._seen[rank].info or {}
        try:  # first, so peers join this verdict instead of blaming this rank's exit
            self.ctx.put(f"hb/{self.ctx.rank}", {"done": True, "aborted": {"target": rank, "what": what}})
        except Exception:
            pass
        log.error(
            "ftkit watchdog (rank %d): rank %d is %s: %s; ending this worker so torchrun restarts the group",
            self.ctx.rank,
            rank,
            what,
            why,
        )
        self.events.emit("detect", target=rank, what=what, latency_s=latency, why=why, step=self._step)
        self.detections.append({"target": rank, "what": what})
        if self._local(info) and info.get("pid"):
            try:  # a stopped or hung process on this host would hold up the restart
                os.kill(int(info["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # A commit needs every rank's share: with a dead or frozen rank, no
        # snapshot in flight can finish, and draining would only wait out the
        # flush deadline before the restart. A straggler is alive: let it drain.
        if self._flush is not None and what == "straggler":
            try:
                self._flush(self.cfg.flush_deadline_s)
            except Exception as e:
                log.error("ftkit watchdog: flush before abort failed: %s", e)
        self.events.emit("abort", reason=f"rank {rank} {what}", step=self._step)
        self.events.close()
        logging.shutdown()
        os._exit(EXIT_CODE)
