"""What one tier's commit keeps on this rank from one step to the next, so that a step costs
the values that changed, not the layouts that did not: the layouts it knows and sent
(commit/layouts.py), the reports it decoded (commit/reports.py), its node's layout lines and
the parts it checked (commit/parts.py).

One `CommitMemo` per tier of one Checkpointer (commit/node.py NodeGroup holds it): it goes
away with them, and nothing is kept per process. Bounded: the least recently put entry goes
first. A rank's persist thread is its only user; the locks are for the tests and benches
that play several ranks in one process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from ftkit.commit.layouts import Layout
    from ftkit.commit.parts import NodeLayout
    from ftkit.commit.reports import RankReport

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class CommitMemo:
    """The caches of one tier's commit on one rank (see the module's docstring). `scale`
    multiplies the bounds: a bench that plays hundreds of ranks in one process gives them
    room for all of them."""

    def __init__(self, scale: int = 1) -> None:
        self.layouts: Lru[str, Layout] = Lru(256 * scale)  # layouts known, by name
        self.sent: Lru[tuple[Any, ...], Layout] = Lru(8 * scale)  # this rank's layouts, by structure
        self.decoded: Lru[tuple[int, bytes], RankReport] = Lru(16 * scale)  # reports decoded
        self.node_layouts: Lru[tuple[str, ...], NodeLayout] = Lru(8 * scale)  # parts' layout lines
        self.checked_parts: Lru[tuple[Any, ...], bool] = Lru(16 * scale)  # parts validated, by geometry
