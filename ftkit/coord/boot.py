"""When this worker process reached each milestone of its start, in wall-clock seconds: the
launchers and the rendezvous handler stamp them, the Checkpointer's ``start`` event records
them, ``ftkit report`` turns them into phases. In order (any may be missing):

    process     the process torchrun started began (the warm client's start, else the OS's)
    forked      a warm start: the zygote forked this worker
    launch      imports done: ftkit's launcher runs the script, or ``import ftkit`` finished
    rendezvous  init_process_group's env:// rendezvous began
    store       the rendezvous store is connected; the process group is built next
    failed      an in-process recovery, instead of the above: the failure reached its wrapper
    torn_down   the failed generation's process group is destroyed
    regrouped   the new generation's group is built
"""

from __future__ import annotations

import os
import time

from ftkit.runtime.warm.client import PROCESS_T_ENV, process_start  # PROCESS_T_ENV: when torchrun's process began

MILESTONES = ("process", "forked", "launch", "rendezvous", "store", "failed", "torn_down", "regrouped")

_marks: dict[str, float] = {}


def mark(milestone: str, t: float | None = None) -> None:
    """Stamp `milestone` now (or at `t`); the first stamp of each milestone stands."""
    _marks.setdefault(milestone, time.time() if t is None else t)


def reset() -> None:
    """Forget every stamp (a forked worker must not inherit its zygote's)."""
    _marks.clear()


def marks() -> dict[str, float]:
    """This process's milestones so far, with ``process`` filled in from the environment or the OS."""
    out = dict(_marks)
    if "process" not in out and "failed" not in out:  # (an in-process generation started no process)
        t = _process_start()
        if t is not None:
            out["process"] = t
    return {k: out[k] for k in MILESTONES if k in out}


def _process_start() -> float | None:
    raw = os.environ.get(PROCESS_T_ENV)
    if raw:
        try:
            return float(raw)
        except ValueError:
            pass
    # The process's age by the kernel's clock since boot, taken from now: psutil's create_time()
    # drifts from time.time() by seconds on a VM (a start before the failure it followed).
    start_ticks = process_start(os.getpid())
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: leave the milestone out
        return None
    if start_ticks is None:
        return None
    return time.time() - max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
