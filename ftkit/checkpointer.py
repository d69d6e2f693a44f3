"""The Checkpointer: the object a training loop talks to.

Order of calls::

    ck = Checkpointer({"model": model, "optim": opt, "epoch": 0}, tiers=["/ckpt"])
    start = ck.restore()          # newest valid step from the fastest tier, or 0
    for step in range(start + 1, n + 1):
        ...train...
        ck.snapshot(step)         # returns once the state is staged
    ck.close()                    # flush background work, release buffers

`snapshot` is the only call on the training thread's hot path: it captures the
state (tensors plus a JSON skeleton), takes a free staging slot and copies into
it. Everything else (encoding, checksums, writes, the commit, retention) runs on
one background thread. Background failures are logged and counted, never raised
into the training loop; `wait()` and `close()` re-raise them for callers who ask.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, MutableMapping, Sequence

import torch

from . import capture as cap
from .errors import CheckpointNotFoundError, CorruptCheckpointError, FtkitError, StorageError
from .persist import AlreadyCommitted, delete_step, persist
from .reader import committed_steps, load_manifest, read_tensors
from .retention import plan_retention
from .staging import Layout, Slot, StagingArena
from .storage import Storage
from .tiers import Tier

log = logging.getLogger("ftkit")

POLICIES = ("skip", "wait")


@dataclass
class Stats:
    """Counters a user (or a test) can read at any time."""

    snapshots: int = 0
    skipped: int = 0  # due, but every staging slot was busy (policy "skip")
    persisted: int = 0  # tier commits
    failed: int = 0  # tier persists that failed
    last_stall_s: float = 0.0
    last_committed: dict[str, int] = field(default_factory=dict)  # tier url -> step


@dataclass
class _Job:
    slot: Slot
    step: int
    skeleton: dict[str, Any]
    tiers: list[int]


class Checkpointer:
    """Asynchronous snapshots of training state to storage tiers, and restore.

    state: names -> objects with state_dict()/load_state_dict(), tensors, or
        JSON-safe values. Plain values are restored by assignment into `state`.
    tiers: Tier objects, URLs, or dicts of Tier fields; listed in any order.
    policy: when a snapshot is due but both staging slots are still busy,
        "wait" (default: block until one frees, so no snapshot is lost) or
        "skip" (count it, log it and go on: training never waits on storage).
    max_staging_bytes: cap on staging memory (two slots of the state's size by
        default); when only one slot fits, snapshots take turns on it.
    rng: capture and restore python/numpy/torch(/CUDA) RNG state.
    """

    def __init__(self, state: MutableMapping[str, Any], tiers: Sequence[Tier | str | dict], *,
                 policy: str = "wait", max_staging_bytes: int | None = None, rng: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.state = state
        self.tiers = [Tier.coerce(t) for t in tiers]
        self.policy = policy
        self.rng = rng
        self.stats = Stats()
        # Opening every tier now makes a bad URL or missing backend fail at start.
        self._storages: list[Storage] = [t.open() for t in self.tiers]
        self._arena = StagingArena(slots=2, budget_bytes=max_staging_bytes)
        self._side_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._unfenced: Slot | None = None
        self._errors: list[BaseException] = []
        self._errors_lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._hooks = [obj.register_step_pre_hook(self._fence_hook)
                       for obj in state.values() if isinstance(obj, torch.optim.Optimizer)]
        self._worker = threading.Thread(target=self._run_worker, name="ftkit-persist", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------- snapshots
    def due_tiers(self, step: int) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if step % t.every == 0]

    def snapshot(self, step: int) -> bool:
        """Stage the state for `step`; persist in the background. True if staged."""
        if self._closed:
            raise FtkitError("snapshot() after close()")
        due = self.due_tiers(step)
        if not due:
            return False
        t0 = time.perf_counter()
        captured = cap.capture(self.state, rng=self.rng)
        layout = Layout.of(captured.tensors)
        slot = self._arena.acquire(layout, wait=self.policy == "wait")
        if slot is None:
            self.stats.skipped += 1
            log.warning("snapshot of step %d skipped: the previous snapshots are still being persisted "
                        "(policy 'skip'; %d skipped so far)", step, self.stats.skipped)
            return False
        try:
            slot.fill(captured.tensors, self._side_stream)
        except BaseException:
            self._arena.release(slot)
            raise
        self._unfenced = slot
        self.stats.snapshots += 1
        self.stats.last_stall_s = time.perf_counter() - t0
        self._jobs.put(_Job(slot, step, captured.skeleton, due))
        return True

    def _fence_hook(self, *_args: Any) -> None:
        """Optimizer step pre-hook: the step must not overwrite tensors still being copied."""
        slot, self._unfenced = self._unfenced, None
        if slot is not None:
            slot.fence()

    # ------------------------------------------------------------ background
    def _run_worker(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._persist_job(job)
            finally:
                if job is not None:
                    self._arena.release(job.slot)
                self._jobs.task_done()

    def _persist_job(self, job: _Job) -> None:
        for i in job.tiers:
            tier, storage = self.tiers[i], self._storages[i]
            try:
                t0 = time.perf_counter()
                manifest = persist(storage, job.step, job.slot, job.skeleton, compress=tier.compress)
                self.stats.persisted += 1
                self.stats.last_committed[tier.url] = job.step
                log.info("step %d committed to %s (%.1f MB in %.2fs)", job.step, storage.display_url,
                         manifest.total_stored_bytes / 1e6, time.perf_counter() - t0)
                self._apply_retention(tier, storage, protect=job.step)
            except AlreadyCommitted:
                log.info("step %d already committed to %s; left as it is", job.step, storage.display_url)
            except Exception as e:  # recorded for wait(); training goes on
                self.stats.failed += 1
                log.error("persisting step %d to %s failed: %s", job.step, storage.display_url, e)
                with self._errors_lock:
                    self._errors.append(e)

    def _apply_retention(self, tier: Tier, storage: Storage, protect: int) -> None:
        plan = plan_retention(committed_steps(storage), tier.keep, tier.keep_every, protect=protect)
        for step in plan.delete:
            delete_step(storage, step)
            log.debug("retention removed step %d from %s", step, storage.display_url)

    # ----------------------------------------------------------------- flush
    def wait(self) -> None:
        """Block until all background work is done; re-raise the first failure since the last wait."""
        self._jobs.join()
        with self._errors_lock:
            errors, self._errors = self._errors, []
        if errors:
            if len(errors) > 1:
                log.error("%d background persists failed; raising the first", len(errors))
            raise errors[0]

    def close(self) -> None:
        """Flush background work, release staging memory and hooks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._worker.join()
            for h in self._hooks:
                h.remove()
            self._arena.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            log.exception("ftkit: error while closing the checkpointer during another exception")

    # --------------------------------------------------------------- restore
    def restore(self, step: int | None = None) -> int:
        """Load the newest valid step (or `step`) in place; return it, or 0 if none exists.

        Tiers are tried fastest first; a step whose bytes fail verification on one
        tier is tried on the next, then the next newest step is tried. Raises if
        checkpoints exist but none is usable, or if a tier could not be read and
        nothing was found elsewhere (restarting from scratch would lose work).
        """
        if not self._closed:
            self.wait()
        order = sorted(range(len(self.tiers)), key=lambda i: self.tiers[i].speed_rank)
        available: dict[int, list[int]] = {}  # step -> tier indices, fastest first
        unreachable: list[str] = []
        for i in order:
            try:
                steps = committed_steps(self._storages[i])
            except StorageError as e:
                log.warning("cannot list %s: %s", self._storages[i].display_url, e)
                unreachable.append(str(e))
                continue
            for s in steps:
                available.setdefault(s, []).append(i)
        if step is not None:
            if step not in available:
                raise CheckpointNotFoundError(f"step {step} is not committed on any tier "
                                              f"({', '.join(s.display_url for s in self._storages)})")
            candidates = [step]
        else:
            candidates = sorted(available, reverse=True)
        problems: list[str] = []
        for s in candidates:
            for i in available[s]:
                storage = self._storages[i]
                try:
                    t0 = time.perf_counter()
                    manifest = load_manifest(storage, s)
                    tensors = read_tensors(storage, manifest)
                    cap.apply(self.state, manifest.skeleton, tensors, rng=self.rng)
                    log.info("restored step %d from %s (%.1f MB in %.2fs)", s, storage.display_url,
                             manifest.total_raw_bytes / 1e6, time.perf_counter() - t0)
                    return s
                except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
                    problems.append(str(e))
                    log.warning("step %d on %s is unusable, trying the next source: %s",
                                s, storage.display_url, e)
        if problems:
            raise CorruptCheckpointError(f"no usable checkpoint: {len(problems)} candidate(s) failed; "
                                         f"newest problem: {problems[0]}")
        if unreachable:
            raise StorageError(f"no checkpoint found and a tier could not be read: {unreachable[0]}")
        return 0

