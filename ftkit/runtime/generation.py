"""This process's generation: how many in-process recoveries it has been through.

An in-process recovery (inprocess.py) re-forms the process group without a new torchrun
attempt, so whatever is namespaced per attempt (store keys, node boards, the event log's
``gen``) is namespaced per (attempt, generation); generation 0 adds nothing. The state is
process-wide: the watchdog thread records a recovery request that the training loop's next
``snapshot()`` raises.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from ftkit.errors import RecoveryRequested

_lock = threading.Lock()
_generation = 0
_active = False
_requested: Any = None  # the verdict that asked for a recovery of the current generation
_instances: dict[int, int] = {}  # Checkpointers created so far, by generation


ROUND_ENV = "FTKIT_RDZV_ROUND"  # exported by ftkit's torchrun agent (ftkit/runtime/warm/agent.py)


def torchrun_attempt(environ: Mapping[str, str] = os.environ) -> str | None:
    """This worker's torchrun attempt, the same on every rank of a group: the rendezvous round
    ftkit's agent exports (new at every round), else torchrun's restart count; None outside torchrun."""
    return environ.get(ROUND_ENV) or environ.get("TORCHELASTIC_RESTART_COUNT")


def current() -> int:
    return _generation


def suffix() -> str:
    """What namespaces add for this generation ("" for generation 0)."""
    return "" if _generation == 0 else f".g{_generation}"


def join(number: int) -> int:
    """Start generation `number` and forget the request: the next one after a recovery, or the
    survivors' (a replacement for a killed worker; inprocess.py). Only the training loop's thread calls it."""
    global _generation, _requested
    with _lock:
        _generation, _requested = number, None
        return number


def next_instance() -> int:
    """The number of the next Checkpointer of this generation, from 1 (a replacement that joins
    the survivors counts as they do: its store keys must be theirs)."""
    with _lock:
        _instances[_generation] = _instances.get(_generation, 0) + 1
        return _instances[_generation]


def set_active(active: bool) -> None:
    """An in-process recovery wrapper runs the training loop (or no longer does)."""
    global _active, _requested
    with _lock:
        _active = active
        if not active:
            _requested = None


def active() -> bool:
    return _active


def request(verdict: Any) -> bool:
    """A verdict asks this generation to recover; True if it is the first request."""
    global _requested
    with _lock:
        first = _requested is None
        if first:
            _requested = verdict
        return first


def raise_if_requested(serves: int | None = None) -> None:
    """Raise RecoveryRequested if a verdict asked this generation to recover, or if generation
    `serves` (what a wait is for) is over."""
    wanted = _requested
    if wanted is not None:
        raise RecoveryRequested(f"rank {wanted.target} {wanted.what}: recovering in process")
    if serves is not None and serves != _generation:
        raise RecoveryRequested("a newer generation: recovering in process")
