"""This process's generation: how many in-process recoveries it has been through.

torchrun numbers its attempts (``torchrun_attempt``: the rendezvous round, or
``TORCHELASTIC_RESTART_COUNT``); an in-process
recovery (ftkit/runtime/inprocess.py) re-forms the process group without a new attempt,
so everything namespaced per attempt is namespaced per (attempt, generation):
the Checkpointer's store keys (coord/dist.py), the node boards (coord/nodelocal.py),
the event log's ``gen`` field (coord/events.py). Generation 0 adds nothing, so
a job that never recovers in process looks exactly as before.

The state is process-wide on purpose: the watchdog thread reads whether a
wrapper is active (a verdict then requests a recovery instead of ending the
process) and the training loop's next ``snapshot()`` raises the request.
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
    """This worker's attempt under torchrun, the same on every rank of a worker group: the
    rendezvous round ftkit's agent exports (new at every round, also when a host joins or
    leaves without a failure), else torchrun's restart count (what it is on one node); None
    outside torchrun. What the store, the node boards and the event log are namespaced by."""
    return environ.get(ROUND_ENV) or environ.get("TORCHELASTIC_RESTART_COUNT")


def current() -> int:
    return _generation


def suffix() -> str:
    """What namespaces add for this generation ("" for generation 0)."""
    return "" if _generation == 0 else f".g{_generation}"


def advance() -> int:
    """Start the next generation (a recovery re-formed the group); forget the request."""
    global _generation, _requested
    with _lock:
        _generation += 1
        _requested = None
        return _generation


def join(number: int) -> None:
    """A replacement for a killed worker starts in the survivors' generation `number` (inprocess.py)."""
    global _generation, _requested
    with _lock:
        _generation = number
        _requested = None


def next_instance() -> int:
    """The number of the next Checkpointer of this generation, from 1: the survivors and a
    replacement that joins them count the same (its store keys must be theirs)."""
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


def requested() -> Any:
    """The verdict that asked for a recovery of the current generation, or None."""
    return _requested


def raise_if_requested() -> None:
    """Raise RecoveryRequested if a verdict asked this generation to recover."""
    wanted = _requested
    if wanted is not None:
        raise RecoveryRequested(f"rank {wanted.target} {wanted.what}: recovering in process")
