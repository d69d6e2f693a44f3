"""Which committed steps a tier keeps: pure plans, and their execution after a commit.

Keep the newest `keep` steps, every step divisible by `keep_every`, and always the
newest step that verified (`protect`). A step that failed a check counts toward
nothing, so bad steps never push out good ones; it is kept until `keep` good steps are
newer (it may have met a transient read error). Retention runs only after a
successful commit, so a failed save never costs a good checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ftkit.errors import StorageError
from ftkit.format.reader import scan
from ftkit.tiers.lifecycle import delete_step
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")


@dataclass(frozen=True)
class RetentionPlan:
    keep: tuple[int, ...]
    delete: tuple[int, ...]


def plan_retention(
    committed: list[int],
    keep: int | None,
    keep_every: int | None = None,
    protect: int | None = None,
    failed: Iterable[int] = (),
) -> RetentionPlan:
    steps = sorted(set(committed))
    if keep is None:
        return RetentionPlan(tuple(steps), ())
    if keep < 1:
        raise ValueError("keep must be at least 1")
    # (A step that failed a check may have met a transient read error: kept, but not counted,
    # until `keep` good steps are newer, when it would go if good.)
    failed = set(failed)
    usable = [s for s in steps if s not in failed]
    kept = set(usable[-keep:]) | {s for s in failed if len(usable) < keep or s > usable[-keep]}
    if keep_every:
        kept |= {s for s in steps if s % keep_every == 0}
    if protect is not None and protect in steps:
        kept.add(protect)
    return RetentionPlan(tuple(s for s in steps if s in kept), tuple(s for s in steps if s not in kept))


@dataclass(frozen=True)
class StepInfo:
    """What the collector knows of one step directory (pure input to plan_collection)."""

    step: int
    status: str  # reader.StepDir.status: committed, partial, retired, empty, link, bad
    verified: bool | None = None  # committed steps: None when not checked
    age_s: float | None = None  # since its newest file changed; None when unknown


@dataclass(frozen=True)
class CollectionPlan:
    """What `ftkit gc` (and a job's retention) deletes, keeps and refuses on one tier."""

    keep: tuple[int, ...]  # committed steps kept
    delete: tuple[int, ...]  # committed steps removed
    remove_partial: tuple[int, ...]  # partial, retired and empty directories removed
    held: tuple[int, ...]  # partial directories left alone: younger than the grace period
    refused: tuple[int, ...]  # symbolic links and non-regular manifests: never touched, reported
    protected: int | None  # the newest step that verified (None: none did, so no committed step goes)


def plan_collection(steps: list[StepInfo], keep: int, keep_every: int | None, grace_s: float) -> CollectionPlan:
    """Which directories of a tier go. Rules, strongest first:

    * a symbolic link or a manifest that is no regular file is never touched;
    * the newest step that verified is kept, and so is every newer one: they failed, and
      a failed step counts toward no `keep` (when unsure, keep); if none verified, no
      committed step is deleted;
    * otherwise committed steps follow plan_retention(keep, keep_every);
    * a directory without a manifest goes once unchanged for `grace_s` (a writer may be
      filling it), and only if retired, empty or older than the newest committed step.
    """
    committed = [s.step for s in steps if s.status == "committed"]
    protected = max((s.step for s in steps if s.status == "committed" and s.verified), default=None)
    # (survey() verifies newest first until one passes: the newer ones failed, or none passed.)
    failed = [s for s in committed if protected is None or s > protected]
    plan = plan_retention(committed, keep, keep_every, protect=protected, failed=failed)
    newest = max(committed, default=-1)
    # (A partial step newer than every commit is not a candidate: maybe the next commit in flight.)
    gone = [s for s in steps if s.status in ("retired", "empty") or (s.status == "partial" and s.step < newest)]
    remove = tuple(s.step for s in gone if s.age_s is not None and s.age_s >= grace_s)
    held = tuple(s.step for s in gone if s.age_s is None or s.age_s < grace_s)
    refused = tuple(s.step for s in steps if s.status in ("link", "bad"))
    return CollectionPlan(plan.keep, plan.delete, remove, held, refused, protected)


def abort_stale_uploads(storage: Storage, grace_s: float) -> int:
    """Abort ftkit's own incomplete uploads older than `grace_s` below the tier; how many."""
    now = time.time()
    stale = [u for u in storage.incomplete_uploads() if u["own"] and now - u["initiated"] >= grace_s]
    for u in stale:
        storage.abort_upload(u)
    return len(stale)


JOB_UPLOAD_GRACE_S = 6 * 3600.0  # an upload this old is nobody's (a 6-hour single-file upload is not a thing)
JOB_UPLOAD_CHECK_S = 3600.0  # a running job lists incomplete uploads at most this often per tier


def apply_job_retention(
    storage: Storage,
    keep: int | None,
    keep_every: int | None,
    protect: int,
    failed: Iterable[int] = (),
    upload_grace_s: float = JOB_UPLOAD_GRACE_S,
) -> list[int]:
    """A running job's retention after it committed `protect` (trusted, not read back); the
    steps removed. Steps without a manifest older than `protect` were abandoned (commits go in
    step order) and go; newer ones may be in flight. Links and odd manifests are left alone.
    `failed`: the steps this run's restore found unusable here (plan_retention)."""
    dirs = scan(storage)
    refused = [d.step for d in dirs if d.status in ("link", "bad")]
    if refused and storage.url not in _warned:
        _warned.add(storage.url)
        log.warning(
            "ftkit: %s holds step directories that are symbolic links or whose manifest is no regular "
            "file: %s; retention leaves them alone (see `ftkit ls`)",
            storage.display_url,
            refused,
        )
    plan = plan_retention([d.step for d in dirs if d.committed], keep, keep_every, protect=protect, failed=failed)
    abandoned = [d.step for d in dirs if d.status in ("partial", "retired") and d.step < protect]
    removed = list(plan.delete) + abandoned
    for step in removed:
        delete_step(storage, step)
    now = time.monotonic()
    if not storage.is_local and now - _uploads_checked.get(storage.url, -JOB_UPLOAD_CHECK_S) >= JOB_UPLOAD_CHECK_S:
        _uploads_checked[storage.url] = now
        try:
            n = abort_stale_uploads(storage, upload_grace_s)
            if n:
                log.info(
                    "ftkit: aborted %d incomplete upload(s) older than %.0fs below %s",
                    n,
                    upload_grace_s,
                    storage.display_url,
                )
        except StorageError as e:  # only costs money: never a reason to fail a persist
            log.warning("ftkit: could not clear incomplete uploads below %s: %s", storage.display_url, e)
    return removed


_warned: set[str] = set()
_uploads_checked: dict[str, float] = {}  # tier URL -> monotonic time of the last look


def apply_heard_retention(storage: Storage, settled: int | None, kept: frozenset[int]) -> tuple[list[int], int]:
    """Retention on a RAM-tier node without the index (coord/news.py): drop the steps up to
    `settled` (None: nothing heard) not in `kept`. Returns (removed, how many are newer)."""
    dirs = [d for d in scan(storage) if d.status not in ("link", "bad")]
    if settled is None:
        return [], len(dirs)
    removed = [d.step for d in dirs if d.step <= settled and d.step not in kept]
    for step in removed:
        delete_step(storage, step)
    return removed, sum(d.step > settled for d in dirs)
