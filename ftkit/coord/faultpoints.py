"""The drills' hooks inside the data path: where a drill can freeze a rank (or make it raise)
so that its fault lands in the middle of a phase, not between steps (ftkit/drill/job.py).
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

    The drill writes ``{"phase", "step", "rank", "action"}`` to the file $FTKIT_FAULT_POINTS
    names. The first time `rank` reaches `phase` at `step` or later, the request is renamed to
    FILE.reached (it fires once) with this pid in it; then "stop" sends this process SIGSTOP
    (the drill injects its fault, then may SIGCONT), "crash" raises InjectedCrash.
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
