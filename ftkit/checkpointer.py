"""The Checkpointer: the object a training loop talks to.

Order of calls::

    ck = Checkpointer({"model": model, "optim": opt, "epoch": 0}, tiers=["/ckpt"])
    start = ck.restore()          # newest valid step from the fastest tier, or 0
    for step in range(start + 1, n + 1):
        ...train...
        ck.snapshot(step)         # returns once the state is staged
    ck.close()                    # flush background work, release buffers

`snapshot` is the only call on the training thread's hot path. Everything else runs on one
background thread, whose failures are logged, not raised (`wait()` and `close()` re-raise them).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping, Sequence
from typing import Any

from ftkit.config import Tier, resolve_tiers
from ftkit.coord import boot
from ftkit.coord.dist import DistContext
from ftkit.coord.ending import exit_unless_gone, time_first_gradient
from ftkit.coord.events import EventLog
from ftkit.coord.faultpoints import fault_point
from ftkit.coord.preemption import PreemptionHandler, signal_name
from ftkit.coord.watchdog import Watchdog, WatchdogConfig
from ftkit.errors import ConfigError, FtkitError
from ftkit.restore import RestoreContext, Superseded, retire_superseded
from ftkit.restore import restore as _restore
from ftkit.runtime import generation
from ftkit.runtime.warm.client import LAUNCHER_PID_ENV
from ftkit.save import capture as cap
from ftkit.save.pipeline import PersistJob, PersistPipeline, Stats
from ftkit.save.sharding import planned
from ftkit.save.staging import Slot, StagingArena
from ftkit.tiers.opened import open_tiers
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit")

POLICIES = ("skip", "wait")


class Checkpointer:
    """Asynchronous snapshots of training state to storage tiers, and restore.

    state: names -> objects with state_dict()/load_state_dict(), tensors, or JSON-safe
        values (restored into `state`: a dict or list refilled in place, anything else assigned).
    tiers: Tier objects, URLs, or dicts of Tier fields, in any order (or one of them alone).
    policy: when a snapshot is due but both staging slots are busy, "wait" (default: block
        until one frees) or "skip" (count it, log it, go on).
    max_staging_bytes: cap on staging memory (default: two slots of the state's size).
    rng: capture and restore python/numpy/torch(/CUDA) RNG state (per rank).
    commit_timeout_s: how long rank 0 waits for the other ranks' data before giving up on a step.
    peer_timeout_s: bound on one peer transfer.
    run_dir: where the JSONL event log goes (default $FTKIT_RUN_DIR; none: no log).
    run_id: this run's identity: a "ram" tier only restores a run of the same identity.
        Default: $FTKIT_RUN_ID (or $FTKIT_JOB_ID), else the durable tiers' locations, else
        torchrun's --rdzv-id; a "ram" tier with none of these is refused.
    preemption_signals: on these, the next snapshot() saves that step to every tier, waits for
        the commit and exits with 128 + the signal. None (default): SIGTERM, handled from the
        start under torchrun or torch.distributed, else from the first snapshot(); given:
        from the start; (): signals left alone. An earlier handler is chained (preemption.py).
    preemption_deadline_s: exit anyway if no step ends this long after the signal.
    requeue_signals: preemption signals after whose final save rank 0 asks SLURM to run the job
        again (for `--signal=USR1@120` pass [signal.SIGUSR1]); handled from the start.
    watchdog: under torch.distributed, run the heartbeat watchdog (True, or a WatchdogConfig):
        it ends this worker when another rank is dead or hung, so torchrun restarts the group.
    exit_after_failure_s: under torchrun, when the `with` block ends in an exception,
        os._exit(1) if still alive this long after (a wait on a dead peer would hold up the
        restart). None: never.

    Under torch.distributed every rank creates a Checkpointer over the same state structure
    and calls snapshot(step) and restore() with the same arguments. Plain tensors are taken
    to be replicated (as under DDP) and saved once, split across ranks; DTensors (FSDP2) are
    saved as shards; rank 0 commits a step only when every rank's share is durable.
    """

    # The background persister; a subclass may swap it (benchmarks/bench_gpu.py does).
    pipeline_class: type[PersistPipeline] = PersistPipeline

    def __init__(
        self,
        state: MutableMapping[str, Any],
        tiers: Sequence[Tier | str | dict] | Tier | str | dict,
        *,
        policy: str = "wait",
        max_staging_bytes: int | None = None,
        rng: bool = True,
        commit_timeout_s: float = 300.0,
        peer_timeout_s: float = 60.0,
        run_dir: str | None = None,
        watchdog: bool | WatchdogConfig = True,
        preemption_signals: Sequence[int] | None = None,
        preemption_deadline_s: float = 60.0,
        requeue_signals: Sequence[int] = (),
        exit_after_failure_s: float | None = 1.0,
        run_id: str | None = None,
    ):
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, not {policy!r}")
        if not tiers:
            raise ConfigError("at least one tier is needed")
        if max_staging_bytes is not None and (
            isinstance(max_staging_bytes, bool)
            or not isinstance(max_staging_bytes, (int, float))
            or not 0 < max_staging_bytes < float("inf")  # (nan and inf too)
        ):
            raise ConfigError(f"max_staging_bytes must be a number of bytes > 0 or None, not {max_staging_bytes!r}")
        self.state = state
        self.tiers = resolve_tiers(tiers)  # a "peer" entry becomes the RAM tier's replicas
        self.policy = policy
        self.rng = rng
        self.stats = Stats()
        # Every rank creates its Checkpointers in the same order (counted per generation).
        self._ctx = DistContext.detect(timeout_s=commit_timeout_s).scoped(f"ck{generation.next_instance()}/")
        self._bg_ctx = self._ctx.own_connection()  # the persist thread's (see DistContext.own_connection)
        self._restores = 0  # restore() calls so far: namespaces their store keys
        self.last_restore: dict[str, Any] = {}
        self._superseded: Superseded | None = None  # what the last restore superseded, until the next snapshot
        # Opening every tier now makes a bad URL or missing backend fail at start.
        opened = open_tiers(self.tiers, self._ctx, run_id, peer_timeout_s)
        self.ram_identity = opened.ram_identity
        self._ram_hold = opened.ram_hold  # released at close: `ftkit gc ram` may then remove the tier
        self._backends = opened.backends
        self._arena = StagingArena(slots=2, budget_bytes=max_staging_bytes)
        self._plans: dict[tuple, Any] = {}  # the latest sharding plan (save/sharding.py planned)
        self._unfenced: Slot | None = None
        self._closed = False
        self._stopping_on_purpose = False  # a preemption's final save: exiting is the plan
        self._exit_after_failure_s = exit_after_failure_s
        # What is started below is undone if a later part fails (a run dir that cannot be
        # made, a watchdog that cannot start): no hook, thread or signal handler outlives it.
        with contextlib.ExitStack() as undo:
            # Every optimizer step in the process waits (on the GPU) for the newest snapshot's copy,
            # and module buffers (updated in place by forward) are copied in stream order (staging.py).
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hooks = [register_optimizer_step_pre_hook(lambda *_: self.fence())]
            undo.callback(self._hooks[0].remove)
            self._in_order = cap.module_buffer_names(state)
            self.events = EventLog(run_dir or os.environ.get("FTKIT_RUN_DIR"), self._ctx.rank)
            undo.callback(self.events.close)
            emit, release = self.events.emit, self._arena.release
            self._pipeline = self.pipeline_class(opened, self._bg_ctx, self.stats, emit, release)
            undo.callback(self._pipeline.close, 0.0)
            self.events.emit(
                "start",
                world_size=self._ctx.world_size,
                node=self._ctx.node,
                pid=os.getpid(),
                launcher=int(os.environ.get(LAUNCHER_PID_ENV) or os.getpid()),  # the process torchrun started
                boot=boot.marks(),
                tiers=[redact_url(t.url) for t in self.tiers],
                **({"ram_run": self.ram_identity.name} if self.ram_identity else {}),
            )
            signals = (signal.SIGTERM,) if preemption_signals is None else tuple(preemption_signals)
            self._preemption = (
                PreemptionHandler(signals, preemption_deadline_s, self.events.emit, requeue_signals, self._ctx.rank)
                if signals or requeue_signals
                else None
            )
            # Where not wanted from the start, the first snapshot() takes the signals (restore-only: never).
            if self._preemption is not None and (
                preemption_signals is not None
                or requeue_signals
                or self._ctx.distributed
                or "TORCHELASTIC_RUN_ID" in os.environ
            ):
                self._preemption.install()
                undo.callback(self._preemption.uninstall)
            self._watchdog: Watchdog | None = None
            if watchdog and self._ctx.distributed:
                self._watchdog = Watchdog(
                    self._ctx.own_connection(),
                    self.events,
                    watchdog if isinstance(watchdog, WatchdogConfig) else None,
                    flush=self._pipeline.drain,
                    preemption=self._preemption,
                    news=opened.ram_news,
                )
                time_first_gradient(state, self._watchdog)
                self._watchdog.start()
            undo.pop_all()  # all started: close() owns them now

    # ------------------------------------------------------------- snapshots
    def due_tiers(self, step: int) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if step % t.every == 0]

    def snapshot(self, step: int) -> bool:
        """Stage the state for `step`; persist in the background. True if staged."""
        if self._closed:
            raise FtkitError("snapshot() after close()")
        step = _step_arg(step, "snapshot")
        pre = self._preemption
        if pre is not None:
            pre.install()  # a training loop: a final save on preemption is wanted (no-op after once)
        if self._watchdog is not None:
            self._watchdog.progress(step)
        self.events.emit("step", step=step)
        fault_point("step", step, self._ctx.rank)
        generation.raise_if_requested()  # under run_in_process: a peer failed, the group re-forms
        if pre is not None and pre.requested is not None and pre.final_step_reached(self._ctx, step):
            self._save_and_exit(step)
        due = self.due_tiers(step)
        return self._stage(step, due) if due else False

    def _save_and_exit(self, step: int) -> None:
        """Preempted: take this step to every tier, wait for the commits, then exit."""
        assert self._preemption is not None
        sig = self._preemption.requested or signal.SIGTERM
        t0 = time.perf_counter()
        try:
            self._stage(step, list(range(len(self.tiers))), wait=True)  # (even under policy "skip")
            self.wait()
        except Exception as e:  # this step's failure, or an older step's that wait() raises now
            log.error("ftkit: the final save after %s: %s", signal_name(sig), redact_url(str(e)))
        ok = all(self.stats.last_committed.get(redact_url(t.url)) == step for t in self.tiers)
        self._preemption.done()
        self._stopping_on_purpose = True
        self.events.emit("preempt_flush", step=step, ok=ok, seconds=time.perf_counter() - t0)
        log.warning("ftkit: step %d %s; exiting", step, "saved to every tier" if ok else "NOT saved")
        self._preemption.after_final_save(self._ctx)  # requeue the job, if the signal asks for it
        if threading.current_thread() is not threading.main_thread():
            # SystemExit would end this thread only, and the process later with status 0: the
            # step is saved, so end the process here, as the main thread's SystemExit would.
            self.close()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(128 + sig)
        raise SystemExit(128 + sig)

    def _stage(self, step: int, due: list[int], wait: bool | None = None) -> bool:
        """Capture, take a staging slot and copy: the part of snapshot() the training thread waits for.
        `wait` for a slot when all are busy (None: as the policy says); False if skipped."""
        if self._superseded is not None:  # the first snapshot after a restore: forget the abandoned future
            superseded, self._superseded = self._superseded, None
            retire_superseded(self._restore_context(), superseded, f"restore/{self._restores - 1}/retired")
        t0 = time.perf_counter()
        ctx = self._ctx
        captured = cap.capture(self.state, rng=self.rng, rng_path=f"{cap.RNG_KEY}/r{ctx.rank}")
        pieces, layout = planned(
            captured.tensors, ctx.rank, ctx.world_size, plans=self._plans, layouts=self._arena.layouts
        )
        named = [(p.name, src) for p, src in pieces]
        with self._waiting():
            slot = self._arena.acquire(layout, wait=self.policy == "wait" if wait is None else wait)
        if slot is None:  # policy "skip", every slot busy: the others hear it now (on this thread)
            self._pipeline.skipped(ctx, step, self._restores, due)
            return False
        try:
            fault_point("snapshot", step, ctx.rank)
            slot.fill(named, in_order=self._in_order)  # large copies on the arena's side stream
        except BaseException:
            self._arena.release(slot)
            raise
        self._unfenced = slot
        self.stats.snapshots += 1
        self.stats.last_stall_s = time.perf_counter() - t0
        self.events.emit(
            "snapshot", step=step, stall_s=self.stats.last_stall_s, bytes=slot.layout.total_bytes if slot.layout else 0
        )
        by_name = {p.name: p for p, _ in pieces}
        self._pipeline.submit(
            PersistJob(slot, step, captured.skeleton, due, by_name, captured.rank_state, self._restores)
        )
        return True

    def mark_compute_done(self) -> None:
        """This rank's compute for the step is done: call it right before a step's first
        collective in a custom loop (DDP gets a comm hook that does it, unless it has one),
        so the watchdog can compare ranks' busy times to find stragglers."""
        if self._watchdog is not None:
            self._watchdog.mark_first_gradient()

    def fence(self) -> None:
        """Make the current CUDA stream wait until the newest snapshot's copies are done (no-op on CPU).

        Every optimizer.step() does this first. Call it before an in-place write to parameters
        or optimizer state between snapshot() and the next optimizer step (an EMA, p.data.mul_()).
        """
        slot, self._unfenced = self._unfenced, None
        if slot is not None:
            slot.fence()

    # ----------------------------------------------------------------- flush
    def wait(self) -> None:
        """Block until all background work is done; re-raise the first failure since the last wait."""
        with self._waiting():
            self._pipeline.wait()

    def _waiting(self) -> contextlib.AbstractContextManager[None]:
        """A wait of the training thread inside ftkit: the watchdog takes it for no hang."""
        return self._watchdog.waiting() if self._watchdog is not None else contextlib.nullcontext()

    def close(self, failed: bool = False) -> None:
        """Flush background work, release staging memory and hooks. Idempotent. `failed` (the loop
        raised): peers hear it at once, and with several ranks background persists are not waited for."""
        if self._closed:
            return
        self._closed = True
        try:
            if failed:
                if self._watchdog is not None:
                    self._watchdog.stop(failed=True)
                if not self._ctx.distributed:
                    self.wait()
            else:
                if self._watchdog is not None:  # the loop is over first: a long final flush is no hang
                    self._watchdog.finish()
                self.wait()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()
            if self._preemption is not None:
                self._preemption.uninstall()
            # (one rank alone waited above; with several, a failed rank's commit needs peers that stop too)
            ended = self._pipeline.close(timeout=0.0 if failed and self._ctx.distributed else None)
            self.events.emit(
                "close",
                stats={"snapshots": self.stats.snapshots, "failed": self.stats.failed, "skipped": self.stats.skipped},
            )
            for h in self._hooks:
                h.remove()
            if ended:  # (else a persist may still read the staging buffers, and log its events: the exiting
                self.events.close()  # process frees the buffers and closes the log)
                self._arena.close()
                if self._ram_hold is not None:  # (else it may still write the RAM tier: held till exit)
                    self._ram_hold.close()
            if self._preemption is not None and not self._stopping_on_purpose:
                self._preemption.end_as_asked()  # a signal that came too late for a final save

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        on_purpose = exc_type is None or (
            isinstance(exc, SystemExit) and (exc.code in (0, None) or self._stopping_on_purpose)
        )
        if (
            not on_purpose
            and self._exit_after_failure_s is not None
            and self._ctx.distributed
            and "TORCHELASTIC_RUN_ID" in os.environ
            and not generation.active()  # (run_in_process recovers instead; it has its own bound)
        ):
            exit_unless_gone(self._exit_after_failure_s, exc)
        try:
            self.close(failed=not on_purpose)
        except Exception:
            if exc_type is None:
                raise
            log.exception("ftkit: error while closing the checkpointer during another exception")

    # --------------------------------------------------------------- restore
    def restore(self, step: int | None = None) -> int:
        """Load the newest valid step (or `step`) in place; return it, or 0 if none exists.

        Sources are tried fastest first, then the next newest step. Raises if checkpoints exist
        but none is usable, or a tier could not be read and nothing was found elsewhere.
        `last_restore` then says where this rank's bytes came from and each phase's time.
        """
        if step is not None:
            step = _step_arg(step, "restore")
        if not self._closed:
            self.wait()
        key = f"restore/{self._restores}"
        self._restores += 1
        restored, self.last_restore, self._superseded = _restore(self._restore_context(), step, key)
        return restored

    def continue_from(self, step: int) -> None:
        """This run goes on from `step` without restore(): it starts over (0), or its state came
        from elsewhere (a Trainer's own checkpoint, a DCP one). The tiers' steps newer than
        `step`, an earlier run's, are retired at the first snapshot, as after a restore of an
        older step: they would refuse this run's snapshots of the same numbers, and a restart
        would resume them. Every rank calls it, before its first snapshot."""
        step = _step_arg(step, "continue_from")
        listed: dict[int, list[int]] = {}
        if self._ctx.rank == 0:  # the shared tiers' steps it retires (a RAM tier's leaders drop every newer one)
            for i, backend in enumerate(self._backends):
                if not backend.node_local:
                    listed[i] = [s for s in backend.committed_steps() if s > step]
        self._superseded = Superseded(step, listed)

    def _restore_context(self) -> RestoreContext:
        return RestoreContext(self.state, self.rng, self._ctx, self._backends, self._arena, self.events.emit)


def _step_arg(step: Any, call: str) -> int:
    """A step argument as an int: any integer type (numpy's, a 0-dim integer tensor) is taken;
    anything else, a bool or a negative number is refused here, not in the background."""
    try:
        n = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        n = None
    if n is None or n < 0:
        shown = " ".join(repr(step).split())[:60]  # (one line, also for a tensor)
        raise ConfigError(f"{call}(step): the step must be an int >= 0, not {shown} ({type(step).__name__})")
    return n
