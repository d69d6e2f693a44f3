"""The reference trainer with two watchdog faults injected that must not kill anyone.

Rank 1's heartbeat thread dies at step 5 (the training thread restarts it), and
at step 15 every rank loses the store for longer than the dead-rank bound. Both
are injected from here, by patching this process's watchdog: ftkit has no test
hooks of its own for them.
"""

from __future__ import annotations

import sys
import time

import ftkit.checkpointer
import ftkit.drill.reference

_snapshot = ftkit.checkpointer.Checkpointer.snapshot


def _die_once(wd) -> None:
    """The heartbeat thread's next publish ends the thread (SystemExit is no Exception it catches)."""
    publish = wd._publish

    def die() -> None:
        wd._publish = publish
        raise SystemExit

    wd._publish = die


def _store_outage(wd, seconds: float) -> None:
    """The heartbeat thread's store round trip (a node leader's, once per interval) fails for
    `seconds`; the node-local heartbeats go on, as they would with the store down."""
    until = time.monotonic() + seconds
    real = wd._exchange

    def failing(*a, **k):
        if time.monotonic() < until:
            raise ConnectionError("store unreachable (injected)")
        return real(*a, **k)

    wd._exchange = failing


def snapshot(self, step):
    wd = self._watchdog
    if wd is not None and step == 5 and self._ctx.rank == 1:
        _die_once(wd)
    if wd is not None and step == 15:
        _store_outage(wd, 2 * wd.cfg.dead_after_s)
    return _snapshot(self, step)


ftkit.checkpointer.Checkpointer.snapshot = snapshot

if __name__ == "__main__":
    sys.exit(ftkit.drill.reference.main())
