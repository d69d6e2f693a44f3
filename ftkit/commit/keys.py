"""The c10d store keys a step's commit uses, and the bookkeeping that deletes them: a job
that snapshots every step for days must not grow the store by every report it ever sent."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ftkit.coord.dist import DistContext, to_root_keys


def commit_key(tier: int, epoch: int, step: int) -> str:
    """The store keys of one step's commit to one tier. `epoch` (restore() calls so far) keeps
    a step snapshotted again after an in-process restore off its first commit's keys."""
    return f"commit/{tier}/{epoch}/{step}"


# One step's keys under `commit_key`: a node is named by its leader (its first rank).
def shared_records_key(key: str) -> str:
    """The nodes' records for rank 0 on a shared tier (DistContext.send_to_root)."""
    return f"{key}/n"


def ram_records_key(key: str) -> str:
    """The nodes' records for rank 0 on the RAM tier."""
    return f"{key}/r"


def exchange_key(key: str, leader: int) -> str:
    """A node's reports and part, for the nodes it exchanges replicas with (commit/replicas.py)."""
    return f"{key}/w/{leader}"


def index_key(key: str) -> str:
    """Rank 0's committed index, for the nodes that keep a copy ("" when not committed)."""
    return f"{key}/manifest"


class KeyLedger:
    """Store keys one tier's commits left behind, by (restore epoch, step), for a later call to delete."""

    def __init__(self, names: Callable[[str], list[str]]):
        self._names = names
        self._lock = threading.Lock()  # the training thread records skips; the persist thread the rest
        self._keys: list[tuple[tuple[int, int], str]] = []

    @staticmethod
    def node_local(nodes: list[int], exchange: bool) -> KeyLedger:
        """persist_node_local's keys of a skipped step: records, `nodes`' exchanges, the index."""
        exchanged = nodes if exchange else []

        def names(key: str) -> list[str]:
            return [*(exchange_key(key, r) for r in exchanged), *to_root_keys(ram_records_key(key)), index_key(key)]

        return KeyLedger(names)

    @staticmethod
    def shared() -> KeyLedger:
        """persist's keys of a step rank 0 skipped: the nodes' records."""
        return KeyLedger(lambda key: to_root_keys(shared_records_key(key)))

    def record(self, at: tuple[int, int], key: str) -> None:
        """Every key a call with `key` leaves (a skipped step's)."""
        with self._lock:
            self._keys += [(at, k) for k in self._names(key)]

    def record_key(self, at: tuple[int, int], key: str) -> None:
        """One store key, to delete once a later call has moved past it."""
        with self._lock:
            self._keys.append((at, key))

    @contextlib.contextmanager
    def older_than(self, at: tuple[int, int]) -> Iterator[list[tuple[tuple[int, int], str]]]:
        """The (at, key) pairs of calls before `at`, to delete (emptying the list); what is left
        in the list at the end is kept for a later call."""
        with self._lock:
            older = [(t, k) for t, k in self._keys if t < at]
            self._keys = [(t, k) for t, k in self._keys if t >= at]
        try:
            yield older
        finally:
            if older:  # not deleted this time
                with self._lock:
                    self._keys += older


def older_keys(ledger: KeyLedger | None, at: tuple[int, int]):
    return ledger.older_than(at) if ledger else contextlib.nullcontext([])


def delete_keys(ctx: DistContext, older: list[tuple[tuple[int, int], str]]) -> None:
    if older:
        ctx.delete(*(k for _, k in older))
        older.clear()
