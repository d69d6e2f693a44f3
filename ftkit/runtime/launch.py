"""The worker-side launcher of ``ftkit run``: ``python -m ftkit.runtime.launch [--module] TARGET [ARGS...]``.

Before the script runs it installs ftkit's restart-safe ``env://`` rendezvous
(coord/rendezvous.py), so a plain ``init_process_group`` survives torchrun restarts,
and, when ``$FTKIT_STARTUP_DIR`` is set, starts a thread that writes the worker's
start-up phase (PHASES) to ``<dir>/<pid>.json`` for the startup watch (supervise.py).
The script then runs as ``python script.py ARGS`` (or ``python -m``) would run it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time

from ftkit.coord import boot
from ftkit.coord.rendezvous import install
from ftkit.runtime.generation import torchrun_attempt
from ftkit.runtime.warm.client import LAUNCHER_PID_ENV  # a warm worker's client: the process torchrun started

STARTUP_DIR_ENV = "FTKIT_STARTUP_DIR"
# started: this module runs; group: the default process group exists; heartbeat: a Checkpointer's
# watchdog runs; single: a world of one (no peers to wait for).
PHASES = ("started", "group", "heartbeat", "single")  # in order; the last two count as started up
WATCHDOG_THREAD = "ftkit-watchdog"  # the name ftkit/coord/watchdog.py gives its heartbeat thread


def _write_phase(directory: str, phase: str) -> None:
    """Atomically replace this worker's status file, named after the pid torchrun started."""
    pid = int(os.environ.get(LAUNCHER_PID_ENV) or os.getpid())
    doc = {
        "pid": pid,
        "worker": os.getpid(),  # (a replacement stands behind the same pid: runtime/warm/client.py)
        "phase": phase,
        "t": time.time(),
        "rank": os.environ.get("RANK"),
        "attempt": torchrun_attempt(),
    }
    tmp = os.path.join(directory, f".{pid}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(directory, f"{pid}.json"))


def _heartbeat_running() -> bool:
    return any(t.name == WATCHDOG_THREAD and t.is_alive() for t in threading.enumerate())


def _report_milestones(directory: str) -> None:
    """The reporting thread: phase by phase until the first heartbeat."""
    import torch.distributed as dist

    phase = "started"
    try:
        while True:
            if phase == "started" and dist.is_available() and dist.is_initialized():
                phase = "group"
                _write_phase(directory, phase)
            if _heartbeat_running():
                _write_phase(directory, "heartbeat")
                return
            time.sleep(0.1)
    except OSError:  # the directory is gone (ftkit run ended): nothing left to tell
        return


def start_reporting() -> None:
    """Start the milestone reporter if ftkit run asked for one."""
    directory = os.environ.get(STARTUP_DIR_ENV)
    if not directory:
        return
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            _write_phase(directory, "single")
            return
        _write_phase(directory, "started")
    except OSError:
        return
    threading.Thread(target=_report_milestones, args=(directory,), name="ftkit-startup", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    module = bool(argv) and argv[0] in ("-m", "--module")
    if module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m ftkit.runtime.launch [--module] TARGET [ARGS...]", file=sys.stderr)
        sys.exit(2)
    install()
    start_reporting()
    boot.mark("launch")
    sys.argv = list(argv)  # (run_module puts the module's file in argv[0])
    if module:
        sys.path[0] = os.getcwd()  # as `python -m` has it (a warm worker's is the zygote's directory)
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
