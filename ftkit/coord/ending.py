"""Ending a failed worker promptly, and timing each rank's compute under DDP: two small
helpers the Checkpointer installs beside its watchdog (coord/watchdog.py)."""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections.abc import MutableMapping
from typing import Any

from ftkit.coord.watchdog import Watchdog
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit")


def exit_unless_gone(seconds: float, exc: BaseException | None) -> None:
    """End this worker if it is still alive in `seconds` (a daemon timer: a clean exit cancels it)."""

    def end() -> None:
        log.error(
            "ftkit: this worker failed and is still alive %.0fs later (a collective or the process "
            "group's teardown is waiting for a dead peer); ending it so torchrun restarts the group. "
            "The failure:\n%s",
            seconds,
            redact_url("".join(traceback.format_exception(exc))) if exc else "?",
        )
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


def time_first_gradient(state: MutableMapping[str, Any], watchdog: Watchdog) -> None:
    """Under DDP, note when each step's first gradient bucket is ready: a rank's busy time (in
    lockstep training only that can show a straggler). Wraps DDP's stock all-reduce hook."""
    from torch.nn.parallel import DistributedDataParallel

    for obj in state.values():
        if isinstance(obj, DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            def hook(process_group, bucket):
                watchdog.mark_first_gradient()
                return default_hooks.allreduce_hook(process_group, bucket)

            try:
                obj.register_comm_hook(None, hook)
            except RuntimeError:  # the user registered their own hook: keep it
                log.info(
                    "ftkit: DDP already has a comm hook; call ck.mark_compute_done() from it to "
                    "time this rank's compute for straggler detection"
                )
