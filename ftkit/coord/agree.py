"""Agreement across ranks through the store: every rank reports, one rank (or all)
decides, and failures come back per rank.

Nothing is raised mid-flight: a failure goes in the rank's ballot and the caller decides
at a safe point, with every rank's failure in hand. Order of calls (every rank, one `key`)::

    outcome = agree(ctx, key, error=..., value=...)      # None on a rank that only reports
    outcome.raise_if_failed("step 7 not committed")       # or read outcome.failures / values
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.errors import AgreementError


@dataclass(frozen=True)
class Outcome:
    values: list[Any]  # every rank's value, in rank order
    failures: list[tuple[int, str]]  # (rank, error) of the ranks that failed, in rank order

    def first_failure(self, me: int) -> str | None:
        """The first failure as a line: the error, with its rank when not `me`'s."""
        if not self.failures:
            return None
        r, err = self.failures[0]
        return err if r == me else f"{err} (on rank {r})"

    def raise_if_failed(self, what: str) -> None:
        if self.failures:
            detail = "; ".join(f"rank {r}: {e}" for r, e in self.failures)
            raise AgreementError(f"{what}: {detail}", self.failures)


def agree(
    ctx: DistContext, key: str, *, error: str | None = None, value: Any = None, decider: int | None = None
) -> Outcome | None:
    """Every rank reports (`error`, `value`) under `key`. With `decider=None` every rank
    gets the Outcome; with a rank number, only that rank does (the others get None)."""
    ballot = {"error": None if error is None else str(error), "value": value}
    if ctx.distributed and decider is not None and ctx.rank != decider:
        ctx.put(f"{key}/{ctx.rank}", ballot)  # (only report)
        return None
    ballots = ctx.gather(key, ballot)
    failures = []
    for r, b in enumerate(ballots):
        if not isinstance(b, dict) or set(b) != {"error", "value"}:  # the store is untrusted input
            failures.append((r, f"a malformed ballot from rank {r}"))
        elif b["error"] is not None:
            failures.append((r, str(b["error"])))
    values = [b.get("value") if isinstance(b, dict) else None for b in ballots]
    return Outcome(values, failures)
