"""Pieces both trainer integrations share: early tier checks and state adapters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ftkit.config import Tier, resolve_tiers
from ftkit.errors import FtkitError, StorageError
from ftkit.format.reader import committed_steps
from ftkit.tiers.storage import redact_url


def coerce_tiers(tiers: Sequence[Tier | str | dict] | Tier | str) -> list[Tier]:
    if isinstance(tiers, (str, Tier)):
        tiers = [tiers]
    out = resolve_tiers(tiers)
    if not out:
        raise ValueError("at least one tier is needed")
    return out


def check_tiers_reachable(tiers: Sequence[Tier], who: str) -> dict[str, list[int]]:
    """Open and list every tier now, so a bad URL, a missing backend or an unreachable
    endpoint stops the run at start, not at the first save. Returns committed steps per URL."""
    found: dict[str, list[int]] = {}
    for tier in tiers:
        if tier.is_ram:  # node-local, bound to the run: the Checkpointer opens it
            continue
        try:
            found[tier.url] = committed_steps(tier.open())
        except FtkitError as e:
            raise StorageError(f"{who}: checkpoint tier {redact_url(tier.url)} cannot be used: {e}") from None
    return found


def check_every(every_n_steps: int) -> int:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
        raise ValueError(f"every_n_steps must be an int >= 1, not {every_n_steps!r}")
    return every_n_steps


class Adapter:
    """A state entry backed by two functions: what to snapshot, and how to load it back."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]):
        self._get = get
        self._put = put

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, value: Any) -> None:
        self._put(value)


class Stash:
    """A state entry whose restore only keeps the value, for state applied later in the trainer's
    start-up (an optimizer not built yet, RNG state set where the trainer would set it)."""

    def __init__(self, get: Callable[[], Any]):
        self._get = get
        self.loaded: Any = None
        self.has_value = False

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, value: Any) -> None:
        self.loaded = value
        self.has_value = True

    def take(self) -> Any:
        value, self.loaded, self.has_value = self.loaded, None, False
        return value
