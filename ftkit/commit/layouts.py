"""A rank's tensor layout, sent once and named by its hash, in the RAM tier's commit messages.

From one step to the next a rank's report (commit/reports.py NodeReport) differs only in its
data file's name (a new token) and its chunks' checksums: the rest (tensor names, dtypes,
shapes, shards, chunk offsets and lengths) is its *layout*. Sending, encoding, parsing and
checking that layout at every step was most of a rank's commit CPU. So a rank that writes
uncompressed (its chunks keep their places from step to step) sends its layout once, as a
*body* named by its hash, and then per step only its file's name and the checksums, in
chunk order (`NodeReport` "by reference")::

    body:    the tensor list's JSON, with "@ftkit-file@" where the data file's name goes and
             "@ftkit-sum@" where each checksum goes (in the order of the chunks)
    name:    blake2b-160 of the body, hex
    where:   on the rank's node board as layout-<name>.json (its leader reads it),
             in the store under layout/<name> (set by its leader before the first record of
             the node's reports that the replica partners read; never deleted: a few per rank)

Bodies are untrusted like every message: a body is taken only when it hashes to its name,
and a report by reference is validated as the report it stands for (its layout once per
byte count and world size; its file name and checksums at every step). A report whose
layout cannot be found reads as that rank's error: the step is simply not committed.

Order of calls: a sender `layout_of(write, memo)` -> (Layout, checksums) or None (send inline);
a non-leader posts `layout.body` to its board (NodeBoard.post_once) before its report; a
leader publishes its node's bodies in the store (`Published`) before the record naming them.
A receiver decodes reports with `lookup(from_board(...))` or `lookup(from_store(...))`, which
returns known layouts from the tier's memo (commit/memo.py) and fetches, checks and keeps
unknown ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftkit.commit.memo import CommitMemo, Lru
from ftkit.errors import FormatError
from ftkit.format.manifest import tensor_entry_doc

FILE_MARK = '"@ftkit-file@"'
SUM_MARK = '"@ftkit-sum@"'
MAX_BODY_BYTES = 64 * 2**20  # one rank's tensor list: megabytes at most
_DUMMY_SUM = "xxh3_64:" + "0" * 16


def board_name(digest: str) -> str:
    return f"layout-{digest}.json"


def store_key(digest: str) -> str:
    return f"layout/{digest}"


_DIGEST = re.compile(r"[0-9a-f]{40}")


def is_digest(v: Any) -> bool:
    return isinstance(v, str) and _DIGEST.fullmatch(v) is not None


@dataclass(frozen=True)
class Layout:
    """One layout: its body, its name, and what a receiver needs of it at every step."""

    digest: str
    body: str
    n_sums: int

    @staticmethod
    def of_body(body: str, digest: str | None = None) -> Layout:
        """A layout from its body (untrusted): it must hash to `digest`, when given, and have
        its markers only where values go (each checksum's place once; the file's anywhere)."""
        d = hashlib.blake2b(body.encode(), digest_size=20).hexdigest()
        if digest is not None and d != digest:
            raise FormatError(f"layout {digest[:12]} does not hash to its name")
        return Layout(d, body, body.count(SUM_MARK))

    def text(self, file: str, sums: list[str] | tuple[str, ...]) -> str:
        """The tensor list as it reads with `file` and `sums` (json-safe file names only)."""
        pieces = self.body.split(SUM_MARK)
        if len(sums) != len(pieces) - 1:
            raise FormatError(f"{len(sums)} checksums for a layout of {len(pieces) - 1} chunks")
        out = [pieces[0]]
        for s, piece in zip(sums, pieces[1:], strict=True):
            out += [json.dumps(s), piece]
        return "".join(out).replace(FILE_MARK, json.dumps(file))

    def docs(self, file: str, sums: list[str] | tuple[str, ...] | None = None) -> Any:
        """The tensor list parsed (`sums` None: placeholders of the right form)."""
        text = self.text(file, sums if sums is not None else [_DUMMY_SUM] * self.n_sums)
        try:
            return json.loads(text)
        except ValueError as e:
            raise FormatError(f"layout {self.digest[:12]} is not JSON ({e})") from None

    @functools.cached_property
    def spans(self) -> tuple[tuple[str, int, int], ...]:
        """(tensor name, offset, length) of each chunk, in checksum order: the same whatever
        the file's name, so worked out once per layout (a replica holder checks the chunks of
        every file it receives; each step's file has a new name)."""
        return tuple(
            (str(t["name"]), int(c["offset"]), int(c["length"]))
            for t in self.docs("f")
            for s in t["shards"]
            for c in s["chunks"]
        )


def lookup(
    fetch: Callable[[str], bytes | None] | None, memo: CommitMemo | None = None
) -> Callable[[str], Layout | None]:
    """A resolver for NodeReport.decode: the memo's layout of a name, else the body `fetch`
    gets for it (checked against its name, then kept), else None."""
    book = memo.layouts if memo is not None else Lru[str, Layout](256)

    def resolve(digest: str) -> Layout | None:
        hit = book.get(digest)
        if hit is not None or fetch is None:
            return hit
        raw = fetch(digest)
        if raw is None or len(raw) > MAX_BODY_BYTES:
            return None
        try:
            layout = Layout.of_body(raw.decode(), digest)
        except (UnicodeDecodeError, FormatError):
            return None
        book.put(digest, layout)
        return layout

    return resolve


# ------------------------------------------------------------------ the sender's side
def layout_of(write: Any, memo: CommitMemo) -> tuple[Layout, list[str]] | None:
    """(the layout of `write`, its checksums in chunk order), or None when it is not to be sent
    by reference (a chunk in another file, or a tensor named like a marker). Per step this
    walks the chunks once into a flat tuple, looked up among the last few structures sent;
    the body is built and hashed only for a structure not seen before."""
    shape: list[Any] = [write.rank]
    sums = []
    for t in write.tensors:
        shape += (t.name, t.dtype, t.shape, t.kind)
        for s in t.shards:
            shape += (s.offsets, s.lengths, s.rank)
            for c in s.chunks:
                if c.file != write.file:
                    return None
                shape += (c.offset, c.length, c.raw_offset, c.raw_length, c.codec)
                sums.append(c.checksum)
    key = tuple(shape)
    hit = memo.sent.get(key)
    if hit is None:
        hit = (_body_of(write),)
        memo.sent.put(key, hit)
    layout = hit[0]
    if layout is None:
        return None
    memo.layouts.put(layout.digest, layout)  # this rank's own: its leader (maybe itself) needs no fetch
    return layout, sums


def _body_of(write: Any) -> Layout | None:
    docs = [tensor_entry_doc(t) for t in write.tensors]
    n = 0
    for t in docs:
        for s in t["shards"]:
            for c in s["chunks"]:
                c["file"], c["checksum"] = "@ftkit-file@", "@ftkit-sum@"
                n += 1
    body = json.dumps(docs)
    layout = Layout.of_body(body)
    # Markers only where this put them: a tensor named like one would make another layout.
    if layout.n_sums != n or body.count(FILE_MARK) != n:
        return None
    return layout


# ------------------------------------------------------------------ where bodies are
def from_board(board: Any) -> Callable[[str], bytes | None]:
    """Fetch a body from a node's board (coord/nodelocal.py NodeBoard), as its ranks post them."""
    return lambda digest: board.read_bytes(board_name(digest), MAX_BODY_BYTES) if board is not None else None


def from_store(store: Any) -> Callable[[str], bytes | None]:
    """Fetch a body from the store, as node leaders publish them for their replica partners."""

    def fetch(digest: str) -> bytes | None:
        key = store_key(digest)
        try:
            return store.get(key) if store.check([key]) else None
        except Exception:  # the store is gone: the report reads as an error, like any lost message
            return None

    return fetch


class Published:
    """The bodies a node's leader has set in one store (set once; content-named, so setting one
    again, from another process or attempt, is harmless)."""

    def __init__(self) -> None:
        self._store: Any = None
        self._digests: set[str] = set()

    def publish(self, store: Any, layouts: list[Layout]) -> None:
        if store is not self._store:  # a new store (an in-process restart): it has none of them
            self._store, self._digests = store, set()
        for layout in layouts:
            if layout.digest not in self._digests:
                store.set(store_key(layout.digest), layout.body)
                self._digests.add(layout.digest)
