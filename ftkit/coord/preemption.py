"""Preemption: on SIGTERM (or another signal), save to every tier, then exit.

The signal can arrive mid-step, so the handler only records it; the next snapshot(step)
takes that step to every tier, waits for the commit and exits with 128 + the signal (the
ranks agree on the step: `final_step_reached`). If no step ends within the deadline, a
timer ends the process anyway. The handler may ``os._exit``, so it is installed only where
wanted (checkpointer.py). A Python handler installed before is chained, and put back on
close unless another was installed over ftkit's meanwhile. Where there was none, a signal
no step end answered (it came after the last step, or during close()) ends the process
once close() is done, as it would have without ftkit (`end_as_asked`).

Requeue (`requeue_signals`, coord/requeue.py): rank 0 asks the scheduler to run the job
again after the final save (the others wait for it) or at the deadline, on its own or a
peer's signal. The signal's lead time should cover the deadline plus the requeue (30 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ftkit.coord.requeue import requeue as scheduler_requeue
from ftkit.errors import FormatError
from ftkit.runtime.warm.client import die_like

REQUEUED_KEY = "preempt/requeued"  # set by rank 0 once it has asked the scheduler to requeue
REQUEUE_WAIT_S = 45.0  # how long the other ranks wait for it before exiting anyway

log = logging.getLogger("ftkit")


def preemption_notice(rank: int, signum: int) -> dict[str, int]:
    """What a preempted rank tells the others (through the store and its node's board)."""
    return {"rank": rank, "signal": int(signum)}


def parse_preemption_notice(doc: Any) -> tuple[int, int] | None:
    """(rank, signal) of a notice read back, or None when it is not one (untrusted input:
    a signal that is not a valid one on this host reads as SIGTERM)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rank"), int) or isinstance(doc["rank"], bool):
        return None
    signum = doc.get("signal")
    valid = {int(s) for s in signal.valid_signals()}
    return doc["rank"], signum if type(signum) is int and signum in valid else int(signal.SIGTERM)


def signal_name(signum: int) -> str:
    """SIGTERM, SIGUSR1, ...; "signal 40" for one without a name (a realtime signal)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionHandler:
    def __init__(
        self,
        signals: Sequence[int],
        deadline_s: float,
        emit: Callable[..., Any],
        requeue_signals: Sequence[int] = (),
        rank: int = 0,
    ):
        self.rank = rank
        self.requeue_signals = tuple(int(s) for s in requeue_signals)
        self.signals = tuple(dict.fromkeys([*signals, *self.requeue_signals]))  # a requeue signal is one too
        self.deadline_s = deadline_s
        self.emit = emit
        self.requested: int | None = None
        self.first_boundary: int | None = None  # the first step end this rank reached after the signal
        self.final_step: int | None = None  # the step every rank agreed to save and stop at
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._tried = False
        # request() runs in the signal handler and on the watchdog's thread (a peer's notice).
        # Reentrant: a second signal may interrupt the handler on the main thread.
        self._lock = threading.RLock()
        self._retired = False
        self._held: int | None = None  # a signal whose default action (the process ends) waits for a final save

    def install(self) -> None:
        """Take over the signals (once; Python allows it on the main thread only)."""
        if self._tried:
            return
        self._tried = True
        if threading.current_thread() is not threading.main_thread():
            log.warning("ftkit: Checkpointer used off the main thread; preemption signals not handled")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        previous = self._previous.get(signum)
        if self._retired:  # uninstalled under a handler that has since put ours back: pass it on
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default action, as if we had never been here
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
            return
        self.request(signum)
        if callable(previous):  # not SIG_DFL / SIG_IGN / None (a handler set from C)
            previous(signum, frame)
        elif previous != signal.SIG_IGN and signum not in self.requeue_signals:  # (that asks for time, not an end)
            self._held = signum  # its default action waits for close(): end_as_asked

    def request(self, signum: int, by_rank: int | None = None) -> None:
        """Stop at an agreed step: this rank got `signum`, or (by_rank) a peer did, heard through
        the watchdog (a scheduler may signal one node only; every rank must join the save)."""
        with self._lock:
            if self.requested is not None:
                return
            self.requested = signum
        name = signal_name(signum)
        why = f"{name} received" if by_rank is None else f"rank {by_rank} got {name}"
        log.warning("ftkit: %s: saving the state at the end of this step (deadline %.0fs)", why, self.deadline_s)
        self.emit(
            "preempt", signal=name, deadline_s=self.deadline_s, **({} if by_rank is None else {"by_rank": by_rank})
        )
        timer = threading.Timer(self.deadline_s, self._out_of_time)
        timer.daemon = True
        with self._lock:
            if self._timer is not None:  # (never two deadlines)
                self._timer.cancel()
            self._timer = timer
        timer.start()

    def _out_of_time(self) -> None:
        log.error(
            "ftkit: no step ended within the %.0fs preemption deadline; exiting without a final save", self.deadline_s
        )
        self.emit("preempt_timeout")
        if self.requeue_due():  # the newest step saved before is the one the next run restores
            self.requeue(timeout_s=10.0)
        os._exit(128 + (self.requested or signal.SIGTERM))

    def final_step_reached(self, ctx, step: int) -> bool:
        """After a preemption notice: is `step` the one every rank saves and stops at? Never blocks
        (a waiting rank would hold the others in a collective): at its first step end after the
        notice each rank raises a shared maximum to step + 2 (in lock-step training nobody has
        finished that step yet) and counts itself in; once all are in, the stop is the maximum."""
        if not ctx.distributed:
            return True
        if self.first_boundary is None:
            self.first_boundary = step
            _raise_to(ctx.store, "preempt/stop", step + 2)  # before counting this rank in
            ctx.store.add("preempt/ranks", 1)
        if self.final_step is None:  # O(1) requests per rank, whatever the world size
            if int(ctx.store.add("preempt/ranks", 0)) < ctx.world_size:
                return False  # someone has not heard yet; the watchdog will tell it
            self.final_step = _int(ctx.store.get("preempt/stop"), "preempt/stop")
        return step >= self.final_step

    def done(self) -> None:
        """The final save is committed (or failed): stop the deadline timer."""
        if self._timer is not None:
            self._timer.cancel()

    def requeue_wanted(self) -> bool:
        """Whether the signal (this rank's or a peer's) asks for the job to run again."""
        return self.requested is not None and self.requested in self.requeue_signals

    def requeue_due(self) -> bool:
        """Whether this rank requeues the job after the final save: rank 0, on a requeue signal."""
        return self.rank == 0 and self.requeue_wanted()

    def after_final_save(self, ctx) -> None:
        """Requeue from rank 0 once the final save is committed (or failed). The others wait for
        it (at most REQUEUE_WAIT_S): a rank exiting first could end the job step (srun's
        --kill-on-bad-exit) before rank 0 has asked."""
        if not self.requeue_wanted():
            return
        if self.rank == 0:
            self.requeue()
            if ctx.distributed:
                with contextlib.suppress(Exception):
                    ctx.store.set(REQUEUED_KEY, "1")
        elif ctx.distributed:
            with contextlib.suppress(Exception):
                ctx.store.wait([REQUEUED_KEY], timedelta(seconds=REQUEUE_WAIT_S))

    def requeue(self, timeout_s: float = 30.0) -> None:
        """Ask the scheduler to requeue the job (coord/requeue.py); logged and recorded either way."""
        ok, said = scheduler_requeue(timeout_s)
        (log.warning if ok else log.error)("ftkit: %s", said)
        self.emit("requeue", ok=ok, detail=said)

    def uninstall(self) -> None:
        """Put back each handler ours replaced. Where another was installed over ours, ours stays
        in its chain (it may put ours back later): retired, it only passes signals on."""
        self.done()
        self._retired = True
        if threading.current_thread() is threading.main_thread():
            for sig, prev in list(self._previous.items()):
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
                    del self._previous[sig]

    def end_as_asked(self) -> None:
        """After uninstall(), where no final save answered a signal held (it came after the last
        step, or during close()): end the process by it, as its default action would have."""
        sig = self._held
        if sig is None or signal.getsignal(sig) != signal.SIG_DFL:  # (not put back: a handler over ours decides)
            return
        log.warning("ftkit: %s came after the last step; all saved, the process ends as it asks", signal_name(sig))
        die_like({"signal": sig})


def _raise_to(store, key: str, value: int) -> None:
    """Make the integer at `key` at least `value` (compare-and-set until it holds)."""
    current = store.compare_set(key, "", str(value))  # creates it if missing; returns what is there
    while _int(current, key) < value:  # another rank raised it meanwhile: try again from its value
        current = store.compare_set(key, current, str(value))


def _int(raw: bytes, key: str) -> int:
    """A step number from the store (untrusted): FormatError naming the key when it is none."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if not (text.isascii() and text.isdigit() and len(text) < 20):
        raise FormatError(f"store key {key!r} holds {text[:40]!r}, not a step number")
    return int(text)
