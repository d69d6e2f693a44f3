"""What one tier's commit keeps on a rank between steps, so a step costs the values that
changed: layouts, decoded reports, node layout lines and checked parts. Bounded; the locks
are for tests and benches that play several ranks in one process."""

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
    """The caches of one tier's commit on one rank; `scale` multiplies the bounds (for benches)."""

    def __init__(self, scale: int = 1) -> None:
        self.layouts: Lru[str, Layout] = Lru(256 * scale)  # layouts known, by name
        self.sent: Lru[tuple[Any, ...], Layout] = Lru(8 * scale)  # this rank's layouts, by structure
        self.decoded: Lru[tuple[int, bytes], RankReport] = Lru(16 * scale)  # reports decoded
        self.node_layouts: Lru[tuple[str, ...], NodeLayout] = Lru(8 * scale)  # parts' layout lines
        self.checked_parts: Lru[tuple[Any, ...], bool] = Lru(16 * scale)  # parts validated, by geometry
