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
