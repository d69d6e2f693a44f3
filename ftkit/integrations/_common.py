"""Pieces both trainer integrations share: early tier checks and state adapters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ftkit.checkpointer import Checkpointer
from ftkit.config import Tier, resolve_tiers
from ftkit.errors import FtkitError, StorageError
from ftkit.format.reader import committed_steps
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit")


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


class CallbackBase:
    """What both FtkitCallbacks share: their tiers, which steps they snapshot, and their Checkpointer's end."""

    def __init__(self, tiers: Sequence[Tier | str | dict] | Tier | str, every_n_steps: int, policy: str):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, not {every_n_steps!r}")
        self.tiers = resolve_tiers(tiers)  # (one tier given alone is one tier)
        if not self.tiers:
            raise ValueError("at least one tier is needed")
        self.every_n_steps = every_n_steps
        self.policy = policy
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0  # the step the last training run resumed from (0: started fresh)
        self._last_step = -1

    def _maybe_snapshot(self, step: int, last: bool = False) -> None:
        """Snapshot `step` when every_n_steps says so, or (`last`) as training ends."""
        due = last or step % self.every_n_steps == 0
        if step <= 0 or step == self._last_step or not due or self.checkpointer is None:
            return
        self._last_step = step
        self.checkpointer.snapshot(step)

    def _end_checkpointer(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        """End as the Checkpointer's own ``with`` block does: the peers hear of a failure at once."""
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Flush pending snapshots and release the staging buffers; re-raise a background failure."""
        self._end_checkpointer(None, None, None)  # (the Checkpointer's __exit__ without an exception: close())

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            log.exception("ftkit: error while closing the checkpointer")


class Adapter:
    """A state entry backed by two functions: what to snapshot, and how to load it back."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]):
        self._get = get
        self._put = put

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, value: Any) -> None:
        self._put(value)


class Stash(Adapter):
    """A state entry whose restore only keeps the value, for state applied later in the trainer's
    start-up (an optimizer not built yet, RNG state set where the trainer would set it)."""

    def __init__(self, get: Callable[[], Any]):
        super().__init__(get, self._keep)
        self.loaded: Any = None  # None until restored (a rank the snapshot did not have)

    def _keep(self, value: Any) -> None:
        self.loaded = value

    def take(self) -> Any:
        value, self.loaded = self.loaded, None
        return value
