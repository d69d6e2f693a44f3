"""A rank's tensor layout (all of its write but the per-step values), sent once as a JSON
*body* named by its blake2b-160 hash: on the board (layout-<name>.json) before the first
report naming it, and in the store (layout/<its node's leader>/<name>) by its collector
before the exchange naming it, deleted by that collector once no replica partner can still
read a report naming it (`Published`). Bodies are untrusted: one is taken only
when it hashes to its name and has the shape of a layout; its content is validated with its
part (commit/parts.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftkit.commit.memo import CommitMemo
from ftkit.commit.messages import CODECS, Report
from ftkit.commit.plan import CommitPlan
from ftkit.errors import FormatError
from ftkit.format.manifest import tensor_entry_doc
from ftkit.format.part import layout_docs
from ftkit.format.validate import parse_json

if TYPE_CHECKING:
    from ftkit.coord.dist import DistContext

MAX_BODY_BYTES = 64 * 2**20  # one rank's tensor list: megabytes at most
_CODEC = {name: i for i, name in enumerate(CODECS)}
_CHUNK_FIELDS = operator.attrgetter("offset", "length", "codec", "checksum", "raw_offset", "raw_length", "file")


def board_name(digest: str) -> str:
    return f"layout-{digest}.json"


def store_key(leader: int, digest: str) -> str:
    """A body in the store, set by the collector of the node of `leader` (its first rank)."""
    return f"layout/{leader}/{digest}"


@dataclass(frozen=True)
class Layout:
    digest: str  # its name
    body: str

    @staticmethod
    def of_body(body: str, digest: str | None = None) -> Layout:
        """A layout from its body (untrusted), which must hash to `digest` when given."""
        d = hashlib.blake2b(body.encode(), digest_size=20).hexdigest()
        if digest is not None and d != digest:
            raise FormatError(f"layout {digest[:12]} does not hash to its name")
        layout = Layout(d, body)
        _ = layout.chunk_names  # its shape, checked
        return layout

    @functools.cached_property
    def docs(self) -> list[dict[str, Any]]:
        """The rank's tensor entries without their per-step values (format/part.py)."""
        docs = parse_json(self.body, f"layout {self.digest[:12]}", "body")
        if not isinstance(docs, list) or not all(isinstance(t, dict) for t in docs):
            raise FormatError(f"layout {self.digest[:12]} is not a list of tensor entries")
        return docs

    @functools.cached_property
    def chunk_names(self) -> tuple[str, ...]:
        """The tensor name of each chunk, in the layout's order."""
        try:
            return tuple(str(t["name"]) for t in self.docs for s in t["shards"] for _ in s["chunks"])
        except (TypeError, KeyError) as e:
            raise FormatError(f"layout {self.digest[:12]} has malformed entries ({type(e).__name__})") from None


def lookup(fetch: Callable[[int, str], bytes | None] | None, memo: CommitMemo) -> Callable[[int, str], Layout | None]:
    """A resolver of (a rank, the name of its layout): the memo's, else the body `fetch` gets
    (checked, kept), else None."""
    book = memo.layouts

    def resolve(rank: int, digest: str) -> Layout | None:
        hit = book.get(digest)
        if hit is not None or fetch is None:
            return hit
        raw = fetch(rank, digest)
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
def layout_of(write: Any, memo: CommitMemo, state: Any = None) -> tuple[Layout, Report]:
    """(the layout of `write`, a RankWrite; its report, with `state`); hashed only when new."""
    shape: list[Any] = [write.rank]
    chunks: list[Any] = []
    for t in write.tensors:
        shape += (t.name, t.dtype, t.shape, t.kind)
        for s in t.shards:
            shape += (s.offsets, s.lengths, s.rank)
            chunks += s.chunks
    # The chunks' fields as columns, in C loops: a rank may have thousands of chunks.
    columns = tuple(zip(*map(_CHUNK_FIELDS, chunks))) or ((),) * 7
    offsets, lengths, codec_names, sums, raw_offsets, raw_lengths, files = columns
    if any(f != write.file for f in set(files)):
        raise ValueError(f"rank {write.rank} wrote a chunk to another file than {write.file}")
    key = (tuple(shape), raw_offsets, raw_lengths)
    layout = memo.sent.get(key)
    if layout is None:
        body = json.dumps(layout_docs([tensor_entry_doc(t) for t in write.tensors]), separators=(",", ":"))
        layout = Layout.of_body(body)
        memo.sent.put(key, layout)
    memo.layouts.put(layout.digest, layout)  # its collector, maybe this rank, needs no fetch
    text = json.dumps(state or {}, separators=(",", ":"), allow_nan=False)
    codecs = tuple(map(_CODEC.__getitem__, codec_names))
    return layout, Report(write.file, write.nbytes, layout.digest, offsets, lengths, codecs, sums, text)


# ------------------------------------------------------------------ where bodies are
def from_board(board: Any, me: int) -> Callable[[int, str], bytes | None]:
    """Fetch a body sent to `me` on a node's board (NodeBoard.send_once)."""
    return lambda _, digest: board.take(board_name(digest), me, MAX_BODY_BYTES) if board is not None else None


def from_store(store: Any, plan: CommitPlan) -> Callable[[int, str], bytes | None]:
    """Fetch a rank's body from the store, where its node's collector publishes it for its replica partners."""

    def fetch(rank: int, digest: str) -> bytes | None:
        key = store_key(plan.roles_of(rank).leader, digest)
        try:
            return store.get(key) if store.check([key]) else None
        except Exception:  # the store is gone: the report reads as an error
            return None

    return fetch


class Published:
    """The bodies a node's collector has set in one store. Each step's are set before the
    exchange naming them (`publish`); those the step no longer names are deleted after the
    partners' exchanges are read (`retire`), once each partner rank's report of the step
    shows it is past the step before, the last one that could name them."""

    def __init__(self) -> None:
        self._store: Any = None
        self._digests: set[str] = set()  # set, not deleted
        self._stale: set[str] = set()  # of those, the ones this step's reports do not name

    def publish(self, ctx: DistContext, leader: int, layouts: list[Layout]) -> None:
        """Set the bodies of `layouts`, every one the node's reports name (none: its part failed)."""
        if ctx.store is not self._store:  # a new store (an in-process restart) has none of them
            self._store, self._digests = ctx.store, set()
        for layout in layouts:
            if layout.digest not in self._digests:
                ctx.store.set(store_key(leader, layout.digest), layout.body)
                self._digests.add(layout.digest)
        # A failed part's reports may still name any of them: nothing is stale then.
        self._stale = self._digests - {layout.digest for layout in layouts} if layouts else set()

    def retire(self, ctx: DistContext, leader: int, partner_reports: Iterable[bytes]) -> None:
        """Delete the stale bodies if every partner rank wrote this step: its report came after
        it finished the step before. A skip or an error may come from a rank still behind."""
        if self._stale and all(_is_a_write(raw) for raw in partner_reports):
            ctx.delete(*(store_key(leader, digest) for digest in self._stale))
            self._digests -= self._stale
            self._stale = set()


def _is_a_write(raw: bytes) -> bool:
    try:
        return Report.decode(raw, "a partner's report").error is None
    except FormatError:
        return False
