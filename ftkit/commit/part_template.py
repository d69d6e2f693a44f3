"""A node leader's part of a RAM-tier step, filled into a template when its ranks report
the layouts they reported before.

From one step to the next a rank's report differs only in its data file's name (a new
token) and its chunks' checksums (format/index.py LayoutMemo; uncompressed chunks keep
their sizes). The part its leader writes then differs only there and in its step. Building
it in full (parsing the reports, merging their tensors, encoding, checking the result)
was about a third of a leader's commit CPU. So the first part of a set of layouts is built
and checked in full (`build_part`), and a template is made of the same build run with
markers in place of each rank's file and checksums; a later part of the same layouts is
the template filled with that step's values: byte for byte what the full build gives
(tests/unit/test_format_index.py), and of a layout already checked (same verdict).

Order of calls: `node_part_bytes(storage, step, reports, ranks, world, memo)` per step (a node's
leader for its node; a replica holder for its source nodes, rebuilding the bytes their
leaders wrote: commit/replicas.py); it
looks the template up by the reports' layout keys (NodeReport.checked_layout) and the
ranks' own state, and falls back to the full build (making the template) when there is
none or a report's values do not fit it.
"""

from __future__ import annotations

import functools
import json
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.commit.manifests import build_part, files_and_tensors
from ftkit.commit.memo import CommitMemo
from ftkit.commit.reports import NodeReport
from ftkit.format.index import part_file_name, part_head, part_json
from ftkit.format.validate import CHECKSUM_RE
from ftkit.tiers.storage import Storage

_MARK = re.compile(r"@@ftkit-(file|sum)-(\d+)-(\d+)@@")


def _file_mark(i: int) -> str:
    return f"@@ftkit-file-{i}-0@@"


def _sum_mark(i: int, k: int) -> str:
    return f"@@ftkit-sum-{i}-{k}@@"


@dataclass(frozen=True)
class PartTemplate:
    """A part's text after its head, cut where a rank's file name or a checksum goes."""

    segments: tuple[str, ...]  # len(slots) + 1 literal pieces
    slots: tuple[tuple[int, int], ...]  # (report index, -1 for its file name or k for its k-th checksum)
    counts: tuple[int, ...]  # checksums per report

    @staticmethod
    def of(writes: Sequence[dict[str, Any]], rank_state: dict[str, Any], ranks: Sequence[int]) -> PartTemplate | None:
        """The template of the part `build_part` makes of `writes` (write docs, in rank order);
        None when they do not have the shape it relies on (every chunk in its rank's file,
        with a checksum of the usual form) or a marker would be ambiguous."""
        marked, counts = [], []
        for i, w in enumerate(writes):
            tensors: list[dict[str, Any]] = []
            k = 0
            for t in w["tensors"]:
                shards = []
                for s in t["shards"]:
                    chunks = []
                    for c in s["chunks"]:
                        checksum = c.get("checksum")
                        if c.get("file") != w["file"] or not (
                            isinstance(checksum, str) and CHECKSUM_RE.fullmatch(checksum)
                        ):
                            return None
                        chunks.append({**c, "file": _file_mark(i), "checksum": _sum_mark(i, k)})
                        k += 1
                    shards.append({**s, "chunks": chunks})
                tensors.append({**t, "shards": shards})
            marked.append({**w, "file": _file_mark(i), "tensors": tensors})
            counts.append(k)
        files, merged = files_and_tensors(marked, "a part template")
        text = part_json(0, list(ranks), files, merged, rank_state).decode()
        head = part_head(0)
        if not text.startswith(head):
            return None
        pieces = _MARK.split(text[len(head) :])
        segments, slots = pieces[0::4], []
        for kind, report, nth in zip(pieces[1::4], pieces[2::4], pieces[3::4], strict=True):
            slots.append((int(report), -1 if kind == "file" else int(nth)))
        # Each checksum exactly once, each file once per chunk and once in "files": no marker
        # came from elsewhere (a tensor named like one) and none went missing.
        sums = [(i, k) for i, n in enumerate(counts) for k in range(n)]
        files_marked = [(i, -1) for i, n in enumerate(counts) for _ in range(n + 1)]
        if sorted(slots) != sorted(sums + files_marked):
            return None
        return PartTemplate(tuple(segments), tuple(slots), tuple(counts))

    def fill(self, step: int, files: Sequence[str], sums: Sequence[Sequence[str]]) -> bytes | None:
        """The part of `step` whose ranks wrote `files` with chunks checksummed `sums`
        (each rank's, in report order); None when they do not fit."""
        if len(files) != len(self.counts) or any(len(s) != n for s, n in zip(sums, self.counts, strict=True)):
            return None
        if any(json.dumps(f)[1:-1] != f for f in files):  # goes in as is: nothing to escape
            return None
        values: list[str] = [*files]
        for rank_sums in sums:
            values += rank_sums
        pieces = self._frame.copy()
        pieces[0] = part_head(step)
        pieces[2::2] = self._pick(values)
        return "".join(pieces).encode()

    @functools.cached_property
    def _frame(self) -> list[str]:
        """[head, segment, value, segment, ..., segment], the head and values left empty: a
        part is its step's head and values put in, then one join (one C call; formatting the
        segments with "%s" scanned the whole text each time, 6x slower)."""
        frame = [""] * (2 * len(self.segments))
        frame[1::2] = self.segments
        return frame

    @functools.cached_property
    def _pick(self) -> Callable[[list[str]], tuple[str, ...]]:
        """The slots' values, in order, from [files..., rank 0's sums..., rank 1's sums...]."""
        starts = [len(self.counts) + sum(self.counts[:i]) for i in range(len(self.counts))]
        at = [i if k < 0 else starts[i] + k for i, k in self.slots]
        if len(at) == 1:
            return lambda values: (values[at[0]],)
        return operator.itemgetter(*at) if at else (lambda values: ())


def node_part_bytes(
    storage: Storage,
    step: int,
    reports: Sequence[NodeReport],
    ranks: Sequence[int],
    world: int,
    memo: CommitMemo,
    name: str | None = None,
) -> tuple[str, bytes, dict[str, dict[str, Any]]]:
    """(file name, bytes, {data file: info}) of the part of a node whose ranks sent `reports`
    (decoded, none an error): filled into a template when one fits, else built in full.
    `name`: the part's file name (a replica holder rebuilding its source's part), else a new one."""
    written = [(r, r.file) for r in reports if r.file is not None]
    rank_state = {str(r.rank): r.rank_state for r in reports}
    try:
        own: str | None = json.dumps(rank_state, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # not JSON: the full build says what is wrong
        own = None
    key = (tuple(ranks), world, tuple((r.rank, r.checked_layout()) for r, _ in written), own)
    template = memo.templates.get(key) if own is not None else None
    if template is not None:
        data = template.fill(step, [f for _, f in written], [r.checksums() for r, _ in written])
        if data is not None:
            files: dict[str, dict[str, Any]] = {f: {"bytes": r.nbytes, "rank": r.rank} for r, f in written}
            return name or part_file_name(min(ranks)), data, files
    writes = [r.write_doc() for r, _ in written]
    built, data, files = build_part(storage, step, writes, rank_state, list(ranks), world, memo.checked_parts)
    if own is not None:
        made = PartTemplate.of(writes, rank_state, ranks)
        if made is not None:
            memo.templates.put(key, made)
    return name or built, data, files
