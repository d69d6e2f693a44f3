"""A node's part of a step (format 4, format/part.py), built from its ranks' reports.

A part is three lines: its head (the step, the node's ranks), its layout (every tensor entry
of the node's ranks without its per-step values) and its values (the data files, and per
chunk its file, offset, length, codec and checksum, in the layout's order; the ranks' own
state). From one step to the next only the head and the values change, so the layout line
is built once per set of the ranks' layouts (`NodeLayout`) and a part is that line between
the step's head and values: nothing of the layout is encoded again.

A node's collector builds its node's part, and the holders of its ranks' replicas rebuild
it from the same reports (commit/replicas.py store_parts) to the same bytes: one function,
`build_part`, of the reports alone.

A part is checked as a reader checks one part alone before it is written (its ranks' reports
are untrusted): in full the first time a set of layouts comes with a given geometry (the
chunks' places, the files' sizes) and rank state, which is every step's after the first;
after that only what the geometry leaves out, the file names and checksums, which decoding
the reports checked.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ftkit.commit.layouts import Layout
from ftkit.commit.memo import CommitMemo
from ftkit.commit.reports import RankReport
from ftkit.errors import FtkitError
from ftkit.format.index import check_part, part_file_name
from ftkit.format.part import encode_layout, encode_part


@dataclass(frozen=True)
class NodeLayout:
    """The layout line of a node's part, and how its chunks' values are picked, in its order,
    from the ranks' values put one after the other."""

    line: bytes
    pick: Callable[[list[Any]], tuple[Any, ...]]

    @staticmethod
    def of(layouts: Sequence[Layout]) -> NodeLayout:
        """The ranks' layouts (in rank order) merged as one part lists them: one entry per
        tensor, in order of first appearance, holding every rank's shards of it."""
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
    """(file name, bytes, {data file: size}) of the part of a node whose ranks sent `reports`
    (in rank order, none an error), checked. `name`: the part's file name (a replica holder
    rebuilding its source's part), else a new one."""
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
