"""The reports ranks send each other through the store while committing a step.

They are untrusted input (anyone who can write the job's store can forge one):
decoding validates them like a manifest (format/validate.py), and one that does
not validate reads as that rank's error, so every rank sees the same outcome and
the step is simply not committed.

* shared tiers (commit/shared.py): one JSON object per rank, {"write", "error", "rank_state"},
  posted to the rank's node board and read by its leader;
* the RAM tier (commit/ram.py): `NodeReport`, two JSON lines (the second empty when
  the rank's tensor layout goes by reference, commit/layouts.py), posted to the rank's
  node board and relayed by its leader in one record for the node.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftkit.commit.layouts import Layout, is_digest
from ftkit.commit.memo import CommitMemo
from ftkit.errors import FormatError
from ftkit.format.index import LayoutMemo
from ftkit.format.manifest import tensor_entry_doc
from ftkit.format.validate import MAX_INT, check_file_name, parse_json, report_tensors
from ftkit.save.write import RankWrite

_CHUNK_SUM = re.compile(r'"checksum": ?"(xxh3_64:[0-9a-f]{16})"')  # a chunk's, as json.dumps writes it
_SUMS = re.compile(r"(?:xxh3_64:[0-9a-f]{16},)*")  # a report's checksums, joined (one C call, not one each)


def shared_report(rank: int, raw: bytes, world_size: int) -> dict[str, Any]:
    """A rank's report to rank 0 (persist), read from the store: untrusted, validated
    like a manifest's parts; one that does not validate reads as that rank's error."""
    where = f"rank {rank}'s report"
    try:
        doc = parse_json(raw, where, "")
        if not isinstance(doc, dict) or not isinstance(doc.get("error"), (str, type(None))):
            raise FormatError(f"{where} is malformed")
        if doc["error"] is None:  # the tensors are validated with the manifest they become part of
            w = doc.get("write")
            if not isinstance(w, dict) or w.get("rank") != rank or not isinstance(w.get("tensors"), list):
                raise FormatError(f"{where} has no write of rank {rank}")
            check_file_name(w.get("file"))
        return doc
    except FormatError as e:
        return {"error": f"unreadable report: {e}", "write": None}


@dataclass(frozen=True)
class NodeReport:
    """One rank's report of its RAM-tier write, as its leader and its replica partners read it.

    Sent as a JSON head line, then the tensor entries: inline (a second JSON line), or, for
    a layout sent before (commit/layouts.py), by reference: the head names the layout
    and carries the step's checksums, and the second line is empty.
    """

    rank: int
    file: str | None
    nbytes: int
    error: str | None
    rank_state: Any  # the rank's own state (its manifest rank_state entry): checked with the part
    tensors_json: str
    skipped: bool = False  # sent by the training thread (policy "skip"), not by a persist thread
    world_size: int = 1
    layout: Layout | None = None  # by reference: the tensor list is this layout's, with `sums`
    sums: tuple[str, ...] = ()
    # The layouts the decoding tier has validated (CommitMemo.checked_reports); None: check every time.
    checked: LayoutMemo | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def encode(
        write: RankWrite | None,
        error: str | None,
        rank_state: Any,
        skipped: bool = False,
        ref: tuple[Layout, list[str]] | None = None,
    ) -> str:
        """The report's text; `ref` (layouts.layout_of(write)): by reference, its body
        posted where the receivers look first."""
        head = {
            "file": write.file if write else None,
            "nbytes": write.nbytes if write else 0,
            "error": error,
            "rank_state": rank_state or {},
            "skipped": skipped,
        }
        if ref is not None and write is not None:
            head["layout"], head["sums"] = ref[0].digest, ref[1]
            return json.dumps(head) + "\n"
        tensors = [tensor_entry_doc(t) for t in write.tensors] if write else []
        return json.dumps(head) + "\n" + json.dumps(tensors)  # json.dumps never emits a raw newline

    @staticmethod
    def decode(
        rank: int,
        text: str,
        world_size: int,
        layouts: Callable[[str], Layout | None] | None = None,
        checked: LayoutMemo | None = None,
    ) -> NodeReport:
        """A report as read from the board or the store: untrusted, so its head is validated
        here (a file name is a plain name inside the step directory; checksums of the one
        form, as many as its layout has chunks) and its tensors by `tensors()`, the only way
        they are read. `layouts` (layouts.lookup) finds the layout a report names."""
        where = f"rank {rank}'s report"
        head_text, _, tensors = text.partition("\n")
        h = parse_json(head_text, where, "head")
        if not isinstance(h, dict) or not isinstance(h.get("error"), (str, type(None))):
            raise FormatError(f"{where} is malformed")
        file = h.get("file")
        if file is not None:
            check_file_name(file)
        nbytes = h.get("nbytes", 0)
        if type(nbytes) is not int or not 0 <= nbytes <= MAX_INT:
            raise FormatError(f"{where} has a bad byte count")
        layout: Layout | None = None
        sums: tuple[str, ...] = ()
        if h.get("layout") is not None:
            layout, sums = _by_reference(h, file, layouts, where)
        return NodeReport(
            rank,
            file,
            nbytes,
            h["error"],
            h.get("rank_state", {}),
            tensors or "[]",
            h.get("skipped") is True,
            world_size,
            layout,
            sums,
            checked,
        )

    def tensors(self, validate: bool = True) -> list[dict[str, Any]]:
        """The reported tensor entries, validated against this report's file
        (validate.report_tensors) unless the caller validates what it builds of them."""
        if validate and self.file is not None:
            self.checked_layout()
        if self.layout is not None:
            assert self.file is not None
            return self.layout.docs(self.file, self.sums)
        docs = parse_json(self.tensors_json, f"rank {self.rank}'s report", "tensor list")
        if self.file is None and docs:
            raise FormatError(f"rank {self.rank}'s report lists tensors but no file")
        return docs

    def checked_layout(self) -> bytes:
        """This report's layout key, its tensors validated the first time it is seen. A rank
        reports the same layout at every step but for its checksums and its file's token: by
        reference, the layout's name says so; inline, the text with them masked does
        (format/index.py LayoutMemo; the file leads the masked bytes, so a chunk naming
        another file is another layout)."""
        assert self.file is not None
        memo = self.checked if self.checked is not None else LayoutMemo()
        meta = (self.nbytes, self.world_size)
        if self.layout is not None:
            layout = f"ref {self.layout.digest} {self.nbytes} {self.world_size}".encode()
        else:
            layout = memo.key(f"{json.dumps(self.file)}\n{self.tensors_json}".encode(), meta)
        if layout not in memo:
            where = f"rank {self.rank}'s report"
            if self.layout is not None:
                docs = self.layout.docs(self.file)
            else:
                docs = parse_json(self.tensors_json, where, "tensor list")
            entries = report_tensors(docs, self.file, self.nbytes, self.world_size, where)
            if not entries and self.nbytes:
                raise FormatError(f"rank {self.rank}'s report lists no tensor for its {self.nbytes}-byte file")
            memo.add(layout)
        return layout

    def checksums(self) -> list[str]:
        """Its chunks' checksums, in the order of its tensor entries (part_template.py; only
        for a report whose layout is known, where the text's order is the entries' order)."""
        if self.layout is not None:
            return list(self.sums)
        return _CHUNK_SUM.findall(self.tensors_json)

    def chunks(self) -> list[tuple[str, int, int, str]]:
        """(tensor name, offset, length, checksum) of each chunk in its file, validated: what
        a replica of the file is checked against."""
        self.checked_layout()
        if self.layout is not None:
            assert self.file is not None
            spans = self.layout.spans
            return [(name, off, n, s) for (name, off, n), s in zip(spans, self.sums, strict=True)]
        return [
            (t["name"], c["offset"], c["length"], c["checksum"])
            for t in self.tensors(validate=False)
            for sh in t["shards"]
            for c in sh["chunks"]
        ]

    def write_doc(self) -> dict[str, Any]:
        """For rank 0's commit, which validates the whole manifest it assembles."""
        return {"rank": self.rank, "file": self.file, "nbytes": self.nbytes, "tensors": self.tensors(validate=False)}


def _by_reference(
    h: dict[str, Any], file: Any, layouts: Callable[[str], Layout | None] | None, where: str
) -> tuple[Layout, tuple[str, ...]]:
    digest, sums = h["layout"], h.get("sums")
    if file is None or not is_digest(digest):
        raise FormatError(f"{where} names a malformed layout")
    if not isinstance(sums, list):
        raise FormatError(f"{where} has malformed checksums")
    try:
        ok = _SUMS.fullmatch(",".join(sums) + "," if sums else "") is not None
    except TypeError:  # not all strings
        ok = False
    if not ok:
        raise FormatError(f"{where} has malformed checksums")
    layout = layouts(digest) if layouts is not None else None
    if layout is None:
        raise FormatError(f"{where} names layout {digest[:12]}, which was not to be found")
    if len(sums) != layout.n_sums:
        raise FormatError(f"{where} has {len(sums)} checksums for a layout of {layout.n_sums} chunks")
    return layout, tuple(sums)


def decode_report(
    rank: int,
    text: str,
    world_size: int,
    layouts: Callable[[str], Layout | None] | None = None,
    memo: CommitMemo | None = None,
) -> NodeReport:
    """A report, or (when it does not even parse) an error report in its place, so that
    every rank sees the same outcome and the step is simply not committed. A leader decodes
    a replica source's reports twice in a step (to check the replicas, to rebuild the part):
    the last few that decoded are kept."""
    key = (rank, world_size, text)
    hit = memo.decoded.get(key) if memo is not None else None
    if hit is not None:
        return hit
    try:
        report = NodeReport.decode(rank, text, world_size, layouts, memo.checked_reports if memo else None)
    except FormatError as e:  # (not kept: a layout not found now may be found later)
        return NodeReport(rank, None, 0, f"unreadable report: {e}", {}, "[]", False, world_size)
    if memo is not None:
        memo.decoded.put(key, report)
    return report


def keep_own(
    text: str, write: RankWrite, rank_state: Any, ref: tuple[Layout, list[str]] | None, world: int, memo: CommitMemo
) -> None:
    """Keep this rank's own report (`text`, just encoded from these values, with no error) as
    decoded: where this rank collects its node, decode_report finds it and nothing is parsed
    back. It holds what decoding the text gives (the JSON of its rank state is the same text),
    so the part built of it is the one its replica holders rebuild from the text."""
    layout, sums = ref if ref is not None else (None, [])
    tensors = "[]" if ref is not None else (text.partition("\n")[2] or "[]")
    report = NodeReport(
        write.rank,
        write.file,
        write.nbytes,
        None,
        rank_state or {},
        tensors,
        False,
        world,
        layout,
        tuple(sums),
        memo.checked_reports,
    )
    memo.decoded.put((write.rank, world, text), report)
