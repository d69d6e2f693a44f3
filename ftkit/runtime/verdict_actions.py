"""What a rank does once a verdict is in, judged by itself or heard from a peer
(coord/watchdog.py judges, coord/judge.py decides).

A judge `abort()`s: its verdict is posted to the store's one verdict key (compare-and-set:
the first judge wins), then `join()`ed; a rank that hears a standing verdict only
`join()`s. Joining relays the verdict to the node's board, records it, then either hands
it to an in-process recovery or kills a local target and ends this worker with `os._exit`
(``sys.exit`` in a thread only ends the thread), so torchrun restarts the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import NoReturn

from ftkit.coord.dist import DistContext
from ftkit.coord.events import EventLog
from ftkit.coord.judge import Beat, Verdict, WatchdogConfig
from ftkit.coord.nodelocal import NodeBoard
from ftkit.format.validate import parse_message
from ftkit.runtime import generation
from ftkit.runtime.warm.client import process_start, replacements_allowed

log = logging.getLogger("ftkit")
EXIT_CODE = 75  # what an aborting rank exits with (EX_TEMPFAIL: try again)
IN_PROCESS_VERDICTS = ("failed", "straggler")  # the ranks judged are alive: run_in_process recovers in place
VERDICT = "wd/verdict"
GONE = "its process is gone"


def kill_if_same(pid: int, start: int | None) -> str | None:
    """SIGKILL `pid` if it is still the process that started at `start` (warm/client.py
    process_start; None: by pid alone). None once killed, else why not (gone, or the pid reused)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)  # holds this process: a reuse of the pid after the check cannot matter
    except ProcessLookupError:
        return GONE
    except (AttributeError, OSError):  # no pidfds here (not Linux 5.3+): check, then kill by pid
        pidfd = None
    try:
        if start is not None and (now := process_start(pid)) != start:
            return GONE if now is None else f"the pid is another process's now (started at tick {now}, not {start})"
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return None
    except ProcessLookupError:
        return GONE
    except PermissionError:
        return "not permitted"
    finally:
        if pidfd is not None:
            os.close(pidfd)


class VerdictActions:
    """One rank's actions on verdicts. `beat_of(rank)`: the last heartbeat this rank saw of
    `rank`; `local(beat)`: whether it is a process on this host (whose pid may be killed);
    `step()`: this rank's last step; `stop`: set when the watchdog must stop (an in-process
    recovery takes over); `flush(deadline_s)`: drain background persists (a straggler)."""

    def __init__(
        self,
        ctx: DistContext,
        events: EventLog,
        board: NodeBoard,
        cfg: WatchdogConfig,
        *,
        beat_of: Callable[[int], Beat | None],
        local: Callable[[Beat | None], bool],
        step: Callable[[], int | None],
        stop: threading.Event,
        flush: Callable[[float], None] | None = None,
    ):
        self.ctx, self.events, self.board, self.cfg = ctx, events, board, cfg
        self._beat_of, self._local, self._step, self._stop, self._flush = beat_of, local, step, stop, flush

    def straggler(self, rank: int, busy: float, median: float) -> None:
        log.warning("ftkit watchdog: rank %d is a straggler: %.3fs per step busy vs median %.3fs", rank, busy, median)
        self.events.emit("straggler", target=rank, busy_s=busy, median_s=median, factor=busy / median, by=self.ctx.rank)
        if self.cfg.straggler_action == "abort":
            self.abort(Verdict(rank, "straggler", 0.0, f"{busy / median:.1f}x slower than the median", self.ctx.rank))

    def post(self, verdict: Verdict) -> Verdict:
        """Post `verdict` unless one is posted already; return the one that stands."""
        won = self.ctx.store.compare_set(VERDICT, "", json.dumps(verdict.to_json()))
        return Verdict.from_json(parse_message(won)) or verdict

    def abort(self, verdict: Verdict, post: bool = True) -> None:
        """This rank judged: post the verdict (or join an earlier one) and end. `post=False`:
        the store is known lost (a request to it would never return): only this node hears."""
        if verdict.what == "hung" and verdict.target != self.ctx.rank:  # can this judge end it?
            verdict = dataclasses.replace(verdict, local=self._local(self._beat_of(verdict.target)))
        try:
            if post:
                verdict = self.post(verdict)
        except Exception as e:  # the store is gone: this node still ends, and tells its ranks
            log.error("ftkit watchdog: could not post the verdict to the store: %s", e)
        self.join(verdict)

    def join(self, verdict: Verdict) -> None:
        """End this rank on `verdict`: relay it to the node, kill a local target, exit."""
        with contextlib.suppress(Exception):  # the node's other ranks see it within 50 ms
            self.board.write("verdict.json", verdict.to_json())
        log.error(
            "ftkit watchdog (rank %d): rank %d is %s: %s%s; ending this worker so torchrun restarts the group",
            self.ctx.rank,
            verdict.target,
            verdict.what,
            verdict.why,
            "" if verdict.by in (self.ctx.rank, -1) else f" (judged by rank {verdict.by})",
        )
        self.events.emit(
            "detect",
            target=verdict.target,
            what=verdict.what,
            latency_s=verdict.latency_s,
            why=verdict.why,
            by=verdict.by,
            step=self._step(),
        )
        if self._recover_in_process(verdict):
            return
        self.kill_if_local(verdict.target)  # a stopped process holds up the restart
        # Only a straggler is alive to finish its share of a commit in flight: drain only then.
        if self._flush is not None and verdict.what == "straggler":
            try:
                self._flush(self.cfg.flush_deadline_s)
            except Exception as e:
                log.error("ftkit watchdog: flush before abort failed: %s", e)
        self._end(f"rank {verdict.target} {verdict.what}")

    def kill_if_local(self, rank: int) -> None:
        beat = self._beat_of(rank)
        if rank != self.ctx.rank and self._local(beat) and beat is not None and beat.pid:
            spared = kill_if_same(beat.pid, beat.start)
            if spared:  # (gone is the usual end of a dead rank; a pid reused since is worth a warning)
                level = logging.INFO if spared == GONE else logging.WARNING
                log.log(level, "ftkit watchdog: not killing pid %d of rank %d: %s", beat.pid, rank, spared)

    def _recover_in_process(self, verdict: Verdict) -> bool:
        """Under ftkit.run_in_process, record the verdict as a recovery request and stop the
        watchdog, for a failed rank or a straggler, or a dead or hung one judged on its own host in a
        job whose warm clients replace killed workers (``ftkit run --replace-dead``; killed here if
        local, and the target itself, hearing it first, ends by SIGKILL as its judge would end it).
        True if so. Without a recovery in `recovery_timeout_s`, end."""
        dying = verdict.what in ("dead", "hung")
        replaceable = dying and verdict.local and replacements_allowed() > 0
        if not generation.active() or not (verdict.what in IN_PROCESS_VERDICTS or replaceable):
            return False
        if dying and verdict.target == self.ctx.rank:  # heard before its judge's SIGKILL landed
            self._end_killed(f"rank {verdict.target} {verdict.what}")
        if dying:
            self.kill_if_local(verdict.target)
        if generation.request(verdict):
            self.events.emit(
                "abort", reason=f"rank {verdict.target} {verdict.what}", step=self._step(), in_process=True
            )
            gen = generation.current()
            timer = threading.Timer(self.cfg.recovery_timeout_s, self._no_recovery, args=(gen,))
            timer.daemon = True
            timer.start()
        self._stop.set()
        return True

    def _no_recovery(self, gen: int) -> None:
        if generation.current() != gen or not generation.active():
            return
        log.error(
            "ftkit watchdog (rank %d): no in-process recovery began within %.0fs of the verdict; ending this "
            "worker so torchrun restarts the group",
            self.ctx.rank,
            self.cfg.recovery_timeout_s,
        )
        self._end("in-process recovery did not begin")

    def _end_killed(self, reason: str) -> NoReturn:
        """End as this rank's judge ends it, by SIGKILL: its warm client replaces a worker killed so
        (an exit code would reach torchrun, which restarts the group)."""
        self.events.emit("abort", reason=reason, step=self._step(), in_process=True)
        self.events.close()
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(128 + signal.SIGKILL)  # (not reached)

    def _end(self, reason: str) -> NoReturn:
        self.events.emit("abort", reason=reason, step=self._step())
        self.events.close()
        logging.shutdown()
        os._exit(EXIT_CODE)
