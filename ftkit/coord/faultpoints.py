"""The drills' hooks inside the data path: places in a snapshot, a persist, a
replication and a commit where a drill can freeze a rank (or make it raise), so
that a kill, a node loss or a storage fault lands in the middle of that phase
rather than between steps (ftkit/drill/job.py drives them).

Without $FTKIT_FAULT_POINTS set, a fault point is one dictionary lookup.
"""

from __future__ import annotations

import json
import os
import signal

FAULT_POINTS_ENV = "FTKIT_FAULT_POINTS"
PHASES = ("step", "snapshot", "persist", "replicate", "commit")


class InjectedCrash(RuntimeError):
    """The exception a drill's `crash` fault raises in the training loop."""


def fault_point(phase: str, step: int, rank: int) -> None:
    """A drill's hook inside `phase`: freeze this process (or raise) when asked to.

    The drill writes a request, ``{"phase", "step", "rank", "action"}``, to the
    file named by $FTKIT_FAULT_POINTS. The first time `rank` reaches `phase` at
    `step` or later, the request is consumed (renamed to FILE.reached, so it
    fires once, in one thread of one rank) and then:

    * action "stop": the reached file gets this process's pid and the process
      stops itself with SIGSTOP; the drill injects its fault (SIGKILL, a node
      loss, a storage outage...) while the rank is frozen mid-phase, and sends
      SIGCONT when the fault lets the rank live on;
    * action "crash": InjectedCrash is raised here.

    Without the environment variable this is one dictionary lookup.
    """
    path = os.environ.get(FAULT_POINTS_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            req = json.load(f)
    except (OSError, ValueError):
        return
    if req.get("phase") != phase or req.get("rank") != rank or step < int(req.get("step", 0)):
        return
    reached = path + ".reached"
    try:
        os.rename(path, reached)  # atomic: exactly one caller wins
    except OSError:
        return
    tmp = reached + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**req, "pid": os.getpid(), "at_step": step}, f)
    os.replace(tmp, reached)
    if req.get("action") == "crash":
        raise InjectedCrash(f"drill: injected crash on rank {rank} at step {step} ({phase})")
    os.kill(os.getpid(), signal.SIGSTOP)
