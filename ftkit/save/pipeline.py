"""The background half of a snapshot: one thread that persists staged slots to their tiers.
A failure is logged, counted and kept for wait(), never raised into the training loop;
every job's slot is released whatever happens. Order of calls (the Checkpointer's)::

    pipeline = PersistPipeline(...)       # starts the thread
    pipeline.submit(job)                  # after a slot is staged (training thread)
    pipeline.skipped(ctx, step, ...)      # or: no slot was free (training thread)
    pipeline.wait()                       # block until idle; re-raise the first failure since the last wait
    pipeline.drain(deadline_s)            # before an abort: let queued work finish, within a bound
    pipeline.close()                      # stop the thread once the queue is empty

A thread close() left running (a failed rank's, or a pipeline never closed) is joined at
interpreter exit, for at most EXIT_JOIN_S, before finalization begins.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.keys import commit_key
from ftkit.coord.dist import DistContext
from ftkit.errors import AlreadyCommitted
from ftkit.save.gcpause import gc_paused
from ftkit.save.sharding import Piece
from ftkit.save.staging import Slot
from ftkit.tiers.opened import OpenedTiers
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit")

# At exit, how long a persist thread still running may take to finish. It must not run once
# the interpreter finalizes: CPython ends a thread that wakes then mid-call, and one in torch's
# C++ (freeing a tensor) takes the process down ("terminate called without an active exception").
EXIT_JOIN_S = 10.0


@dataclass
class Stats:
    """Counters a user (or a test) can read at any time."""

    snapshots: int = 0
    skipped: int = 0  # due, but every staging slot was busy (policy "skip")
    persisted: int = 0  # tier commits
    failed: int = 0  # tier persists that failed
    last_stall_s: float = 0.0
    last_committed: dict[str, int] = field(default_factory=dict)  # tier url (redacted) -> step


@dataclass
class PersistJob:
    slot: Slot
    step: int
    skeleton: dict[str, Any]
    tiers: list[int]
    pieces: dict[str, Piece]
    rank_state: dict[str, Any]  # this rank's own state: its RNG, its RankLocal entries
    epoch: int  # restore() calls before it was staged: commits after a restore use new store keys


class PersistPipeline:
    def __init__(
        self,
        opened: OpenedTiers,
        ctx: DistContext,
        stats: Stats,
        emit: Callable[..., None],
        release: Callable[[Slot], None],
    ):
        self.backends, self.keys = opened.backends, opened.keys
        self.ctx = ctx  # the thread's own store connection (DistContext.own_connection)
        self.stats, self.emit, self.release = stats, emit, release
        self._jobs: queue.Queue[PersistJob | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stopping = False  # the stop mark is queued
        self._thread = threading.Thread(target=self._run, name="ftkit-persist", daemon=True)
        self._thread.start()
        atexit.register(self._join_at_exit)  # (dropped once close() has seen the thread end)

    def submit(self, job: PersistJob) -> None:
        self._jobs.put(job)

    def skipped(self, ctx: DistContext, step: int, epoch: int, tiers: list[int]) -> None:
        """A due snapshot was not staged (policy "skip"): counted, logged, and told to each of
        `tiers`' commits from the training thread (`ctx`), so nobody waits for it."""
        self.stats.skipped += 1
        log.warning(
            "snapshot of step %d skipped: the previous snapshots are still being persisted "
            "(policy 'skip'; %d skipped so far)",
            step,
            self.stats.skipped,
        )
        if not ctx.distributed:
            return
        for i in tiers:
            key = commit_key(i, epoch, step)
            self.backends[i].report_skipped(ctx, key, (epoch, step), "snapshot skipped: staging busy")
            if ctx.rank == 0:  # rank 0 deletes a step's records, and those of one it skipped
                self.keys[i].record((epoch, step), key)

    def wait(self) -> None:
        """Block until all background work is done; re-raise the first failure since the last wait."""
        self._jobs.join()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            if len(errors) > 1:
                log.error("%d background persists failed; raising the first", len(errors))
            raise errors[0]

    def drain(self, deadline_s: float) -> None:
        """Let queued background persists finish, for at most `deadline_s` (before an abort)."""
        end = time.monotonic() + deadline_s
        while self._jobs.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.05)

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread after the queued jobs; wait at most `timeout` (None: until it ends).
        True if it has ended. (A failed rank passes 0: its commit needs peers that stop too.)"""
        self._stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        atexit.unregister(self._join_at_exit)
        return True

    def _stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._jobs.put(None)

    def _join_at_exit(self) -> None:
        """At interpreter exit: let the thread finish its jobs, within EXIT_JOIN_S."""
        self._stop()
        if self._thread.is_alive():
            log.info("ftkit: waiting at most %gs at exit for a background persist to end", EXIT_JOIN_S)
            self._thread.join(EXIT_JOIN_S)
        if self._thread.is_alive():
            log.warning("ftkit: a background persist still runs at exit; the process may end mid-persist")

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                try:
                    self.persist_job(job)
                finally:
                    self.release(job.slot)
            except Exception as e:  # e.g. the slot's copies failed (a device error): for wait(); the thread goes on
                log.error("the persist job of step %d failed: %s", job.step, redact_url(str(e)))
                with self._lock:
                    self._errors.append(e)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()  # the stop mark's

    def persist_job(self, job: PersistJob) -> None:
        """Persist one staged slot to each of its due tiers, in order; then a "persist_job" event."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with gc_paused():
            for i in job.tiers:
                self._persist(job, i)
        self.emit("persist_job", step=job.step, seconds=time.perf_counter() - t0, cpu_s=time.thread_time() - c0)

    def _persist(self, job: PersistJob, i: int) -> None:
        backend = self.backends[i]
        url = redact_url(backend.tier.url)
        try:
            t0, c0 = time.perf_counter(), time.thread_time()
            committed = backend.persist(job, self.ctx, commit_key(i, job.epoch, job.step), self.keys[i])
            cpu_s = time.thread_time() - c0
            self.stats.persisted += 1
            self.stats.last_committed[url] = job.step
            event = dict(step=job.step, tier=url, ok=True, seconds=time.perf_counter() - t0, cpu_s=cpu_s)
            self.emit("persist", **event, committed_by_me=committed is not None, **backend.persist_details())
            if committed is not None:  # rank 0: the commit is ours
                mb, seconds = committed.stored_bytes / 1e6, time.perf_counter() - t0
                log.info("step %d committed to %s (%.1f MB in %.2fs)", job.step, backend.display_url, mb, seconds)
        except AlreadyCommitted:
            log.info("step %d already committed to %s; left as it is", job.step, backend.display_url)
            return
        except Exception as e:  # recorded for wait(); training goes on
            self.stats.failed += 1
            self.emit("persist", step=job.step, tier=url, ok=False, error=redact_url(str(e))[:300])
            log.error("persisting step %d to %s failed: %s", job.step, backend.display_url, redact_url(str(e)))
            with self._lock:
                self._errors.append(e)
            return
        if backend.owns(self.ctx):  # rank 0 (it committed), or each node's leader on the RAM tier
            self._retain(backend, job, url)

    def _retain(self, backend: Any, job: PersistJob, url: str) -> None:
        """Retention after a persist: a failure is logged and recorded as its own event, not as a
        failed persist (the step is committed; the next commit's retention tries again)."""
        try:
            for step in backend.retain(self.ctx, job):
                log.debug("retention removed step %d from %s", step, backend.display_url)
        except Exception as e:
            self.emit("retention", step=job.step, tier=url, ok=False, error=redact_url(str(e))[:300])
            log.warning("retention after step %d on %s failed: %s", job.step, backend.display_url, redact_url(str(e)))
