"""Which committed steps a tier keeps: a pure plan, executed by the caller.

Rules: keep the newest `keep` steps, keep every step divisible by `keep_every`
forever, and never delete the newest step that verified (`protect`), whatever
the numbers say. Retention runs only after a successful commit, so a failed save
can never cost a good checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPlan:
    keep: tuple[int, ...]
    delete: tuple[int, ...]


def plan_retention(committed: list[int], keep: int | None, keep_every: int | None = None,
                   protect: int | None = None) -> RetentionPlan:
    steps = sorted(set(committed))
    if keep is None:
        return RetentionPlan(tuple(steps), ())
    if keep < 1:
        raise ValueError("keep must be at least 1")
    kept = set(steps[-keep:])
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
    """Which directories of a tier go. Rules, in order of strength:

    * a symbolic link or a manifest that is no regular file is never touched;
    * the newest step that verified is kept, and so is every newer step (it did
      not verify, but it may be good: when unsure, keep); if no step verified,
      no committed step is deleted;
    * otherwise committed steps follow plan_retention(keep, keep_every);
    * a directory without a manifest goes only once nothing changed in it for
      `grace_s` (a live writer may be filling it), and only when it is older
      than the newest committed step, retired, or empty.
    """
    committed = [s.step for s in steps if s.status == "committed"]
    verified = [s.step for s in steps if s.status == "committed" and s.verified]
    protected = max(verified) if verified else None
    if protected is None:
        keep_set, delete = tuple(committed), ()
    else:
        plan = plan_retention(committed, keep, keep_every, protect=protected)
        delete = tuple(s for s in plan.delete if s < protected)
        keep_set = tuple(s for s in committed if s not in delete)
    newest = max(committed, default=None)
    remove, held = [], []
    for s in steps:
        if s.status not in ("partial", "retired", "empty"):
            continue
        if not (s.status in ("retired", "empty") or (newest is not None and s.step < newest)):
            continue  # a partial step newer than every commit: maybe the next commit in flight
        (remove if s.age_s is not None and s.age_s >= grace_s else held).append(s.step)
    refused = tuple(s.step for s in steps if s.status in ("link", "bad"))
    return CollectionPlan(keep_set, delete, tuple(remove), tuple(held), refused, protected)
