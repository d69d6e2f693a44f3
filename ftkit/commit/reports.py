"""A rank's report as its collector and its replica partners read it, its layout found.
Reports are untrusted: one that does not decode, or whose layout is missing or does not
fit, reads as that rank's error, so every rank sees the same outcome."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.commit.layouts import Layout
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import CODECS, Report
from ftkit.errors import FormatError
from ftkit.format.validate import parse_json


@dataclass(frozen=True)
class RankReport:
    """Rank `rank`'s report and its layout (None: the report is an error)."""

    rank: int
    report: Report
    layout: Layout | None = None

    @property
    def file(self) -> str | None:
        return self.report.file if self.layout is not None else None

    @property
    def nbytes(self) -> int:
        return self.report.nbytes

    @property
    def error(self) -> str | None:
        return self.report.error

    @property
    def skipped(self) -> bool:
        return self.report.skipped

    @functools.cached_property
    def state(self) -> Any:
        """The rank's own state (its manifest rank_state entry)."""
        state = parse_json(self.report.state, f"rank {self.rank}'s report", "rank state")
        if not isinstance(state, dict):
            raise FormatError(f"rank {self.rank}'s report has a rank state that is not an object")
        return state

    def values(self, file_index: int) -> list[tuple[Any, ...]]:
        """Its chunks as a format-4 part's values list them: (file, offset, length, codec, checksum)."""
        r = self.report
        codecs = map(CODECS.__getitem__, r.codecs)
        return list(zip(itertools.repeat(file_index), r.offsets, r.lengths, codecs, r.checksums))

    def chunks(self) -> list[tuple[str, int, int, str]]:
        """(tensor name, offset, length, checksum) of each chunk: what a replica is checked against."""
        assert self.layout is not None
        r = self.report
        return list(zip(self.layout.chunk_names, r.offsets, r.lengths, r.checksums, strict=True))


def failed(rank: int, error: str) -> RankReport:
    return RankReport(rank, Report.failed(error))


def decode_report(
    rank: int, data: bytes, layouts: Callable[[int, str], Layout | None] | None = None, memo: CommitMemo | None = None
) -> RankReport:
    """Rank `rank`'s report as sent (`data`), its layout found by `layouts`, or an error report
    when it does not decode or its layout is missing or does not fit. Reports that decoded
    are kept in `memo`: a source's are decoded twice a step (replicas, then its part)."""
    key = (rank, data)
    hit = memo.decoded.get(key) if memo is not None else None
    if hit is not None:
        return hit
    where = f"rank {rank}'s report"
    try:
        report = Report.decode(data, where)
        layout = None
        if report.layout is not None and report.error is None:
            layout = layouts(rank, report.layout) if layouts is not None else None
            if layout is None:
                raise FormatError(f"{where} names layout {report.layout[:12]}, which was not to be found")
            if len(layout.chunk_names) != len(report.offsets):
                raise FormatError(f"{where} has {len(report.offsets)} chunks for a layout of {len(layout.chunk_names)}")
        got = RankReport(rank, report, layout)
        _ = got.state  # a rank state that is not JSON: an unreadable report
    except FormatError as e:  # not kept: a layout not found now may be found later
        return failed(rank, f"unreadable report: {e}")
    if memo is not None:
        memo.decoded.put(key, got)
    return got
