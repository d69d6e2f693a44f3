"""Python's cyclic garbage collector held off while a persist job runs: its many short-lived
objects would otherwise bring full collections sooner, on any thread, the training thread
too. Nesting is counted; a collector the program turned off stays off; FTKIT_PERSIST_GC=on
leaves the collector alone."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0
_resume = False  # whether the collector was on when the first holder paused it


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off for the block (from any thread; blocks may overlap)."""
    global _holders, _resume
    if os.environ.get("FTKIT_PERSIST_GC", "").lower() in ("on", "1", "true", "yes"):
        yield
        return
    with _lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
