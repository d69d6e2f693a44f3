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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ftkit.format.manifest import step_dir_name
from ftkit.format.reader import load_manifest, scan, verify
from ftkit.tiers.lifecycle import delete_step
from ftkit.tiers.retention import CollectionPlan, StepInfo, plan_collection
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")

DEFAULT_GRACE_S = 3600.0  # a partial step or an upload this young may belong to a live writer


@dataclass
class Collected:
    plan: CollectionPlan
    failed_verification: dict[int, str] = field(default_factory=dict)  # step -> why
    uploads: list[dict[str, Any]] = field(default_factory=list)  # incomplete uploads aborted (or to abort)
    uploads_held: int = 0  # younger than the grace period
    errors: list[str] = field(default_factory=list)  # deletions that failed (kept)


def survey(
    storage: Storage,
    verify_steps: bool = True,
    progress: Callable[[int, int], Callable[[int], None] | None] | None = None,
) -> tuple[list[StepInfo], dict[int, str]]:
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


def collect(
    storage: Storage,
    keep: int,
    keep_every: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    progress=None,
) -> Collected:
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
