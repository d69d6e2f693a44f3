"""`ftkit gc`: collect a tier's old steps without ever losing the one to restore.

Order of calls (:func:`collect`)::

    survey     scan the step directories (links and non-regular manifests are
               reported, never followed), and how long ago each partial one changed
    verify     newest committed step first: read every chunk and check it, until
               one verifies (the step a restore would use); newer ones that fail
               are kept too (a transient read error must not cost a good step)
    plan       retention.plan_collection: pure, over what the survey found
    execute    delete the planned steps (manifest first), the partial
               directories past the grace period, and, on object stores, the
               multipart uploads that writers killed mid-upload left behind

A running job's retention (Checkpointer) applies the same rules, except that it
trusts the step it has just committed instead of reading it back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .format import step_dir_name
from .lifecycle import delete_step
from .reader import load_manifest, scan, verify
from .retention import CollectionPlan, StepInfo, plan_collection
from .storage import Storage

log = logging.getLogger("ftkit")

DEFAULT_GRACE_S = 3600.0  # a partial step or an upload this young may belong to a live writer


@dataclass
class Collected:
    plan: CollectionPlan
    failed_verification: dict[int, str] = field(default_factory=dict)  # step -> why
    uploads: list[dict[str, Any]] = field(default_factory=list)  # incomplete uploads aborted (or to abort)
    uploads_held: int = 0  # younger than the grace period
    errors: list[str] = field(default_factory=list)  # deletions that failed (kept)


def survey(storage: Storage, verify_steps: bool = True,
           progress: Callable[[int, int], Callable[[int], None] | None] | None = None) -> tuple[list[StepInfo], dict[int, str]]:
    """StepInfo for every step directory, verifying committed steps newest first
    until one verifies. `progress(step, nbytes)` may return an update callable."""
    now = time.time()
    infos: list[StepInfo] = []
    failed: dict[int, str] = {}
    dirs = scan(storage, include_empty=True)
    found_good = not verify_steps
    verdict: dict[int, bool] = {}
    for d in sorted((d for d in dirs if d.committed), key=lambda d: -d.step):
        if found_good:
            break
        try:
            m = load_manifest(storage, d.step)
            verify(storage, m, progress=progress(d.step, m.total_raw_bytes) if progress else None)
            verdict[d.step] = found_good = True
        except (CorruptCheckpointError, CheckpointNotFoundError, StorageError) as e:
            verdict[d.step] = False
            failed[d.step] = str(e)
    for d in dirs:
        age = None
        if not d.committed and d.status != "link":
            changed = storage.modified(step_dir_name(d.step))
            age = None if changed is None else max(0.0, now - changed)
        infos.append(StepInfo(d.step, d.status, verdict.get(d.step, None if verify_steps else True), age))
    return infos, failed


def collect(storage: Storage, keep: int, keep_every: int | None = None, grace_s: float = DEFAULT_GRACE_S,
            dry_run: bool = False, progress=None) -> Collected:
    """Plan and (unless `dry_run`) carry out a collection of `storage` (module docstring).

    Raises CheckpointNotFoundError when the URL holds no step directory and no
    upload at all (a mistyped path is an error, not a quiet success)."""
    infos, failed = survey(storage, progress=progress)
    uploads = storage.incomplete_uploads()
    if not infos and not uploads:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint steps here (is the path right?)")
    plan = plan_collection(infos, keep, keep_every, grace_s)
    now = time.time()
    stale = [u for u in uploads if now - u["initiated"] >= grace_s]
    done = Collected(plan, failed, stale, len(uploads) - len(stale))
    if dry_run:
        return done
    for step in plan.delete + plan.remove_partial:
        try:
            delete_step(storage, step)
        except StorageError as e:
            done.errors.append(str(e))
    for u in stale:
        try:
            storage.abort_upload(u)
        except StorageError as e:
            done.errors.append(str(e))
    return done


def abort_stale_uploads(storage: Storage, grace_s: float) -> int:
    """A running job's share of collection on object stores: abort incomplete
    uploads older than `grace_s` below the tier. Returns how many."""
    now = time.time()
    n = 0
    for u in storage.incomplete_uploads():
        if now - u["initiated"] >= grace_s:
            storage.abort_upload(u)
            n += 1
    return n


JOB_UPLOAD_GRACE_S = 6 * 3600.0  # an upload this old is nobody's (a 6-hour single-file upload is not a thing)
JOB_UPLOAD_CHECK_S = 3600.0  # a running job lists incomplete uploads at most this often per tier


def apply_job_retention(storage: Storage, keep: int | None, keep_every: int | None, protect: int,
                        upload_grace_s: float = JOB_UPLOAD_GRACE_S) -> list[int]:
    """A running job's retention after it committed step `protect`; returns the steps removed.

    The job trusts the step it has just committed (written, checksummed and its
    files re-checked at the commit) rather than reading it back: that is the step
    every rule protects. Committed steps follow plan_retention; directories without
    a manifest older than `protect` were abandoned (rank 0 commits in step order)
    and go; newer ones may be the next steps being written and stay. Symbolic links
    and non-regular manifests are never touched (and said once per tier)."""
    from .retention import plan_retention

    dirs = scan(storage)
    refused = [d.step for d in dirs if d.status in ("link", "bad")]
    if refused and storage.url not in _warned:
        _warned.add(storage.url)
        log.warning("ftkit: %s holds step directories that are symbolic links or whose manifest is no regular "
                    "file: %s; retention leaves them alone (see `ftkit ls`)", storage.display_url, refused)
    plan = plan_retention([d.step for d in dirs if d.committed], keep, keep_every, protect=protect)
    abandoned = [d.step for d in dirs if d.status in ("partial", "retired") and d.step < protect]
    removed = []
    for step in list(plan.delete) + abandoned:
        delete_step(storage, step)
        removed.append(step)
    now = time.monotonic()
    if not storage.is_local and now - _uploads_checked.get(storage.url, -JOB_UPLOAD_CHECK_S) >= JOB_UPLOAD_CHECK_S:
        _uploads_checked[storage.url] = now
        try:
            n = abort_stale_uploads(storage, upload_grace_s)
            if n:
                log.info("ftkit: aborted %d incomplete upload(s) older than %.0fs below %s", n, upload_grace_s,
                         storage.display_url)
        except StorageError as e:  # only costs money: never a reason to fail a persist
            log.warning("ftkit: could not clear incomplete uploads below %s: %s", storage.display_url, e)
    return removed


_warned: set[str] = set()
_uploads_checked: dict[str, float] = {}  # tier URL -> monotonic time of the last look
