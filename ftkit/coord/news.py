"""Commit news: which RAM-tier steps rank 0 keeps, heard by every node's leader at no
store request of its own.

After each RAM step's outcome rank 0 sets one key, a Settled message (commit/messages.py),
which every leader's watchdog reads in its heartbeat multi_get. A leader drops a step
directory only when news of its own epoch says the step is settled and not kept; one
holding more than `UNHEARD_LIMIT` steps unheard of reads the key itself. Anything
malformed is ignored: keeping, never deleting, is the safe side.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ftkit.commit.messages import Settled
from ftkit.errors import FormatError

__all__ = ["NEWS_KEY", "UNHEARD_LIMIT", "CommitNews", "Settled", "publish"]

log = logging.getLogger("ftkit")

NEWS_KEY = "commit/ram-news"  # below the Checkpointer's store scope
UNHEARD_LIMIT = 2  # steps a leader holds unheard of before it asks itself


class CommitNews:
    """The newest news this process heard; fed by the watchdog's heartbeat read (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Settled | None = None

    def heard(self, raw: bytes) -> None:
        if not raw:  # the key as the watchdog created it: no news yet
            return
        try:
            news = Settled.decode(raw)
        except FormatError as e:  # (ignored: keeping, never deleting, is the safe side)
            log.debug("ftkit: ignored the RAM commit news: %s", e)
            return
        with self._lock:
            old = self._latest
            # Within an epoch news only moves forward; a new epoch replaces the old one's.
            if old is None or news.epoch > old.epoch or (news.epoch == old.epoch and news.settled >= old.settled):
                self._latest = news

    def of_epoch(self, epoch: int) -> Settled | None:
        with self._lock:
            news = self._latest
        return news if news is not None and news.epoch == epoch else None

    def ask(self, store: Any) -> None:
        """Read the key now (one request; a missing key is no news)."""
        try:
            if store.check([NEWS_KEY]):
                self.heard(store.get(NEWS_KEY))
        except Exception as e:  # the store is away: no news, nothing deleted
            log.debug("ftkit: could not read the RAM commit news: %s", e)


def publish(store: Any, news: Settled) -> None:
    """Rank 0, after a RAM step's outcome (committed and retained, or failed)."""
    store.set(NEWS_KEY, news.encode())
