"""`ftkit gc`: collect a tier's old steps without ever losing the one to restore.

:func:`collect` surveys the step directories (links and non-regular manifests are reported,
never followed), verifies committed steps newest first until one verifies (the step a
restore would use; newer ones that fail are kept, uncounted: a read error must not cost a good step),
plans with tiers/retention.py, then deletes the planned steps, the partial ones past the
grace period, and ftkit's own abandoned multipart uploads (tiers/uploads.py). A running
job's retention applies the same rules but trusts the step it has just committed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftkit.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidJobIdError,
    RamTierInUseError,
    RunIdentityError,
    StorageError,
    UsageError,
)
from ftkit.format.data import verify
from ftkit.format.manifest import parse_step_dir, step_dir_name
from ftkit.format.reader import load_manifest, scan
from ftkit.tiers.lifecycle import delete_step
from ftkit.tiers.retention import CollectionPlan, StepInfo, plan_collection
from ftkit.tiers.storage import Storage
from ftkit.tools.cliutil import EXIT_FAIL, EXIT_OK, emit, human, open_tier, progress_bar

DEFAULT_GRACE_S = 3600.0  # a partial step or an upload this young may belong to a live writer


@dataclass
class Collected:
    plan: CollectionPlan
    failed_verification: dict[int, str] = field(default_factory=dict)  # step -> why
    uploads: list[dict[str, Any]] = field(default_factory=list)  # incomplete uploads aborted (or to abort)
    uploads_held: int = 0  # younger than the grace period
    uploads_foreign: int = 0  # not ftkit's (another writer's below the prefix): never touched
    errors: list[str] = field(default_factory=list)  # deletions that failed (kept)


def survey(
    storage: Storage,
    progress: Callable[[int, int], Callable[[int], None] | None] | None = None,
) -> tuple[list[StepInfo], dict[int, str]]:
    """StepInfo for every step directory, verifying committed steps newest first until one
    verifies; and the steps that failed, with why. `progress(step, nbytes)` may return an update callable."""
    now = time.time()
    infos: list[StepInfo] = []
    failed: dict[int, str] = {}
    dirs = scan(storage, include_empty=True)
    verdict: dict[int, bool] = {}
    for d in sorted((d for d in dirs if d.committed), key=lambda d: -d.step):
        try:
            m = load_manifest(storage, d.step)
            verify(storage, m, progress=progress(d.step, m.total_raw_bytes) if progress else None)
            verdict[d.step] = True
            break  # the step a restore would use: older ones need no check
        except (CorruptCheckpointError, CheckpointNotFoundError, StorageError) as e:
            verdict[d.step] = False
            failed[d.step] = str(e)
    for d in dirs:
        age = None
        if not d.committed and d.status != "link":
            changed = storage.modified(step_dir_name(d.step))
            age = None if changed is None else max(0.0, now - changed)
        infos.append(StepInfo(d.step, d.status, verdict.get(d.step), age))
    return infos, failed


def collect(
    storage: Storage,
    keep: int,
    keep_every: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    progress=None,
) -> Collected:
    """Plan and (unless `dry_run`) carry out a collection of `storage`.

    Raises CheckpointNotFoundError when the URL holds no step and no upload of ftkit's (a mistyped path)."""
    infos, failed = survey(storage, progress=progress)
    listed = storage.incomplete_uploads()
    uploads = [u for u in listed if u["own"]]
    if not infos and not uploads:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint steps here (is the path right?)")
    plan = plan_collection(infos, keep, keep_every, grace_s)
    now = time.time()
    stale = [u for u in uploads if now - u["initiated"] >= grace_s]
    done = Collected(plan, failed, stale, len(uploads) - len(stale), len(listed) - len(uploads))
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


def cmd_gc(args) -> int:
    if args.url == "ram":
        return _gc_ram(args)
    if args.keep is None:
        raise UsageError("gc needs --keep N (or the URL 'ram' to remove a finished job's RAM tier)")
    if parse_step_dir(args.url.rstrip("/").rsplit("/", 1)[-1]) is not None:
        raise UsageError(f"{args.url} is one step's directory; gc works on the tier above it")
    storage, _ = open_tier(args)
    with contextlib.ExitStack() as bars:  # a bar per step verified, on a terminal

        def progress(step: int, nbytes: int) -> Callable[[int], None] | None:
            return bars.enter_context(progress_bar(nbytes, f"verify step {step}"))

        try:
            done = collect(storage, args.keep, args.keep_every, args.grace, dry_run=args.dry_run, progress=progress)
        except CheckpointNotFoundError as e:
            raise UsageError(str(e)) from None
    plan = done.plan
    verb = "would remove" if args.dry_run else "removed"
    payload = {
        "url": storage.display_url,
        "dry_run": args.dry_run,
        "kept": list(plan.keep),
        "removed": list(plan.delete),
        "removed_partial": list(plan.remove_partial),
        "held_partial": list(plan.held),
        "refused": list(plan.refused),
        "protected": plan.protected,
        "failed_verification": {str(k): v for k, v in done.failed_verification.items()},
        "aborted_uploads": [u["key"] for u in done.uploads],
        "held_uploads": done.uploads_held,
        "foreign_uploads": done.uploads_foreign,
        "errors": done.errors,
    }
    lines = [
        f"{verb} {len(plan.delete)} step(s) {list(plan.delete)} and {len(plan.remove_partial)} partial "
        f"step(s) {list(plan.remove_partial)}; kept {list(plan.keep)}"
    ]
    if plan.protected is None and plan.keep:
        lines.append("no step verified: every committed step was kept")
    else:
        lines.append(f"newest verified step: {plan.protected}")
    for s, why in sorted(done.failed_verification.items()):
        lines.append(f"step {s} failed verification (kept): {why}")
    if plan.held:
        lines.append(f"left alone (changed less than {args.grace:.0f}s ago; a writer may be live): {list(plan.held)}")
    if plan.refused:
        lines.append(f"refused (a symbolic link, or a manifest that is no regular file): {list(plan.refused)}")
    if done.uploads or done.uploads_held:
        lines.append(
            f"{verb} {len(done.uploads)} incomplete upload(s)"
            + (f"; {done.uploads_held} younger than {args.grace:.0f}s left alone" if done.uploads_held else "")
        )
    if done.uploads_foreign:
        lines.append(f"left alone {done.uploads_foreign} incomplete upload(s) that are not ftkit's (see `ftkit ls`)")
    lines += [f"error: {e}" for e in done.errors]
    emit(args, payload, "\n".join(lines))
    return EXIT_FAIL if done.errors else EXIT_OK


def _gc_ram(args) -> int:
    """Remove a finished job's RAM tier (every simulated node's directory) on this machine; one a
    live process here holds (a running job's Checkpointer, tiers/ram.py hold_run) only with --force."""
    from ftkit.tiers.ram import check_unused, existing_job_dir, job_dir, remove_job

    try:  # a job id is a plain name under the RAM root: never a path (not absolute, no "..")
        path = existing_job_dir(args.job)  # checked as for use: ours, private, not a link
    except (InvalidJobIdError, RunIdentityError) as e:
        raise UsageError(str(e)) from None
    if path is None:
        raise CheckpointNotFoundError(f"no RAM tier for job {args.job or '(default)'} at {job_dir(args.job)}")
    size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
    try:
        if not args.dry_run:
            remove_job(args.job, force=args.force)
        elif not args.force:
            check_unused(args.job)
    except RamTierInUseError as e:
        raise RamTierInUseError(
            f"{e} (a running job's Checkpointer): kept; stop the job first, or remove it anyway with --force"
        ) from None
    emit(
        args,
        {"removed": path, "bytes": size, "dry_run": args.dry_run},
        f"{'would remove' if args.dry_run else 'removed'} {path} ({human(size)})",
    )
    return EXIT_OK
