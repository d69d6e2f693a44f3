"""When this worker process reached each milestone of its start, for the recovery breakdown.

A restart's time goes to torchrun's teardown, starting processes, importing
torch, the script's own set-up, the rendezvous, building the process group and
model, the restore and the first step. The launchers and the rendezvous
handler stamp the milestones they see here (wall-clock seconds, as the event
log uses); the Checkpointer writes them into its ``start`` event, and
``ftkit report`` lines the ranks' stamps up into the phases of each incident
(ftkit/tools/report.py).

Milestones, in order (any may be missing: a script not started by an ftkit
launcher has no ``forked``/``launch``; one that imports ftkit after its group
has no ``rendezvous``):

    process     the process torchrun started began (the warm client's start, else the
                OS's create time of this process)
    forked      a warm start: the zygote forked this worker (ftkit/runtime/warm/zygote.py)
    launch      the imports are done: ftkit's launcher is about to run the script, or (a
                script started without it) ``import ftkit`` has finished
    rendezvous  init_process_group's env:// rendezvous began
    store       the rendezvous store is connected; the process group is built next

and, for a generation started by an in-process recovery (ftkit/runtime/inprocess.py) in the
same process, instead of those:

    failed      the failure reached the recovery wrapper on this rank (its loop unwound)
    torn_down   this rank's process group of the failed generation is destroyed
    regrouped   every rank arrived and the new generation's group is built
"""

from __future__ import annotations

import os
import time

from ftkit.runtime.warm.client import PROCESS_T_ENV  # the start of the process torchrun started

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
    # The process's age, from the kernel's clock since boot, taken from now: psutil's
    # create_time() adds the boot time in whole seconds and drifts from time.time() on
    # a VM by seconds, which would put a process's start before the failure it followed.
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux: leave the milestone out
        return None
    return time.time() - max(0.0, age)
