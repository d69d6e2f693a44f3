"""The reference trainer with two watchdog faults injected that must not kill anyone.

Rank 1's heartbeat thread dies at step 5 (the training thread restarts it), and
at step 15 every rank loses the store for longer than the dead-rank bound.
"""

from __future__ import annotations

import sys
import time

import ftkit.checkpointer
import ftkit.drill.reference

_snapshot = ftkit.checkpointer.Checkpointer.snapshot


def snapshot(self, step):
    wd = self._watchdog
    if wd is not None and step == 5 and self._ctx.rank == 1:
        wd._die_for_test = True
    if wd is not None and step == 15:
        wd.store_outage_until = time.monotonic() + 2 * wd.cfg.dead_after_s
    return _snapshot(self, step)


ftkit.checkpointer.Checkpointer.snapshot = snapshot

if __name__ == "__main__":
    sys.exit(ftkit.drill.reference.main())
