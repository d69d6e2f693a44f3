"""Agreement across ranks through the store: every rank reports, rank 0 counts the ballots,
and every rank gets the failures, per rank.

Nothing is raised mid-flight: a failure goes in the rank's ballot and the caller decides
at a safe point, with every rank's failure in hand. Order of calls (every rank, one `key`)::

    outcome = agree(ctx, key, error=..., value=...)
    outcome.raise_if_failed("step 7 not committed")       # or read outcome.failures / values
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftkit.coord.dist import DistContext
from ftkit.errors import AgreementError, FormatError


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


def agree(ctx: DistContext, key: str, *, error: str | None = None, value: Any = None) -> Outcome:
    """Every rank reports (`error`, `value`) under `key` and gets the Outcome: rank 0 reads the
    ballots and sends back only the failures and the values that are not None, so every rank
    reads one short key whatever the world's size."""
    ballot = {"error": None if error is None else str(error), "value": value}
    decided = ctx.share(key, ballot, _count_ballots)
    try:
        failures = [(int(r), str(e)) for r, e in decided["failures"]]
        values = dict.fromkeys(range(ctx.world_size))
        values.update({int(r): v for r, v in decided["values"]})
    except (TypeError, ValueError, KeyError):  # (rank 0's word, through the store: checked)
        raise FormatError(f"rank 0's outcome of {key!r} is malformed") from None
    return Outcome(list(values.values()), failures)


def _count_ballots(ballots: dict[int, Any]) -> dict[str, list[Any]]:
    """Rank 0's outcome of the ballots: (rank, error) of each failure, (rank, value) of each value not None."""
    failures, values = [], []
    for r, b in sorted(ballots.items()):
        if not isinstance(b, dict) or set(b) != {"error", "value"}:  # the store is untrusted input
            failures.append((r, f"a malformed ballot from rank {r}"))
            continue
        if b["error"] is not None:
            failures.append((r, str(b["error"])))
        if b["value"] is not None:
            values.append((r, b["value"]))
    return {"failures": failures, "values": values}
