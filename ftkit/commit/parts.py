"""A node's part of a step (format 4, format/part.py), built from its ranks' reports by
`build_part`, a function of the reports alone (replica holders rebuild the same bytes).
The layout line is built once per set of layouts (`NodeLayout`); a part is checked in full
the first time a set of layouts comes with a given geometry and rank state."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.commit.layouts import Layout
from ftkit.commit.manifests import store_part
from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import Written
from ftkit.commit.reports import RankReport
from ftkit.errors import FtkitError
from ftkit.format.index import check_part, part_file_name
from ftkit.format.part import encode_layout, encode_part
from ftkit.tiers.storage import Storage


@dataclass(frozen=True)
class NodeLayout:
    """The layout line of a node's part, and how to pick its chunks' values from the ranks'."""

    line: bytes
    pick: Callable[[list[Any]], tuple[Any, ...]]

    @staticmethod
    def of(layouts: Sequence[Layout]) -> NodeLayout:
        """The ranks' layouts (in rank order) merged: one entry per tensor, in order of first appearance."""
        merged: dict[str, dict[str, Any]] = {}
        order: dict[str, list[int]] = {}
        at = 0
        for layout in layouts:
            for t in layout.docs:
                n = sum(len(s["chunks"]) for s in t["shards"])
                prev = merged.get(t["name"])
                if prev is None:
                    merged[t["name"]], order[t["name"]] = {**t, "shards": list(t["shards"])}, []
                elif (prev["dtype"], prev["shape"], prev["kind"]) != (t["dtype"], t["shape"], t["kind"]):
                    raise FtkitError(
                        f"ranks disagree about tensor {t['name']!r}: {prev['dtype']}{prev['shape']} "
                        f"vs {t['dtype']}{t['shape']}"
                    )
                else:
                    prev["shards"].extend(t["shards"])
                order[t["name"]] += range(at, at + n)
                at += n
        picks = [i for name in merged for i in order[name]]
        pick: Callable[[list[Any]], tuple[Any, ...]]
        if len(picks) == 1:
            pick = lambda values: (values[picks[0]],)  # noqa: E731
        else:
            pick = operator.itemgetter(*picks) if picks else (lambda values: ())
        return NodeLayout(encode_layout(list(merged.values())), pick)


def build_part(
    step: int,
    reports: Sequence[RankReport],
    world: int,
    memo: CommitMemo,
    name: str | None = None,
) -> tuple[str, bytes, dict[str, int]]:
    """(file name, bytes, {data file: size}) of the checked part of a node whose ranks sent
    `reports` (in rank order, none an error). `name`: the part's file name, else a new one."""
    ranks = [r.rank for r in reports]
    written = [r for r in reports if r.file is not None]
    key = tuple(r.layout.digest for r in written if r.layout is not None)
    node = memo.node_layouts.get(key)
    if node is None:
        node = NodeLayout.of([r.layout for r in written if r.layout is not None])
        memo.node_layouts.put(key, node)
    files = [(r.report.file or "", r.nbytes, r.rank) for r in written]
    values = [v for i, r in enumerate(written) for v in r.values(i)]
    state = {str(r.rank): r.state for r in reports}
    data = encode_part(step, ranks, node.line, files, list(node.pick(values)), state)
    geometry = tuple((r.nbytes, r.report.offsets, r.report.lengths, r.report.codecs) for r in written)
    checked = (key, tuple(ranks), world, geometry, tuple(r.report.state for r in reports))
    if memo.checked_parts.get(checked) is None or len({f for f, _, _ in files}) != len(files):
        where = f"the part of ranks {ranks[0]}-{ranks[-1]} of step {step}"
        check_part(data, step, ranks, world, where)
        memo.checked_parts.put(checked, True)
    return name or part_file_name(min(ranks)), data, {f: n for f, n, _ in files}


def write_part(
    storage: Storage, step: int, reports: Sequence[RankReport], world: int, memo: CommitMemo
) -> tuple[Written | None, list[str]]:
    """A collector's part of its node, built from its ranks' reports and written beside their
    data: (what was written, []) or (None, the node's errors)."""
    errors = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    if errors:
        return None, errors
    try:
        name, data, files = build_part(step, reports, world, memo)
        return store_part(storage, step, name, data, files, [r.rank for r in reports]), []
    except Exception as e:  # a malformed report or a storage failure: the node's error
        return None, [f"node of rank {reports[0].rank}: {e}"]
