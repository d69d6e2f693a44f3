"""`ftkit run`: torchrun with fault-tolerance defaults, the restart-safe launcher and the startup watch.

The command line is planned by supervise.py (`plan`), the workers start
through launch.py, and the startup watch (`StartupWatch`) ends a group
whose workers never sent their first heartbeat.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from ftkit.errors import UsageError
from ftkit.runtime.launch import STARTUP_DIR_ENV
from ftkit.runtime.supervise import StartupWatch, pdeathsig_preexec, plan
from ftkit.runtime.warm.client import REPLACE_ENV
from ftkit.runtime.warm.zygote import start as start_zygote
from ftkit.runtime.warm.zygote import torchrun_command
from ftkit.tools.cliutil import EXIT_OK, EXIT_USAGE

RUN_HELP = """usage: ftkit run [--run-dir DIR] [--startup-timeout S] [--cold] [--preload MODULES]
                 [--replace-dead N] [torchrun options] script.py [script args]

torchrun (python -m torch.distributed.run) with fault-tolerance defaults, for
trainers as they are:

  * --max-restarts 3 and --monitor-interval 0.5 unless given, and --standalone
    unless a rendezvous endpoint or --nnodes is given;
  * FTKIT_RUN_DIR is set to --run-dir (default: $FTKIT_RUN_DIR if set, else
    ./ftkit-run) so Checkpointers log events there; `ftkit report DIR` reads
    them afterwards;
  * every worker starts through ftkit.runtime.launch, which makes a plain
    init_process_group() (init_method env://, the default) safe across torchrun
    restarts: each attempt gets its own namespace in torchrun's store, so no
    worker reads a dead attempt's rendezvous keys. The script needs no change,
    and need not import ftkit before creating its process group;
  * warm starts: a per-node zygote imports torch (and torch._dynamo, ftkit, and
    the comma-separated --preload MODULES) once, and every worker of every
    attempt is forked from it: a restart pays no interpreter start and no
    imports (torchrun starts a thin client per worker that stands in for it:
    signals pass through, its exit code is the worker's). --cold starts every
    worker as a new interpreter instead;
  * --replace-dead N (warm starts): a worker killed while its training loop
    runs in ftkit.run_in_process (SIGKILL, an OOM kill, the watchdog ending a
    hung rank) is replaced by a new one forked from the zygote, up to N times
    per worker, instead of torchrun restarting the group: the other ranks keep
    their processes and re-form the group in process, and the new worker joins
    them and restores from node RAM;
  * a startup watch: a worker that has not sent its first ftkit heartbeat (its
    Checkpointer's watchdog) --startup-timeout seconds (default 600) after it
    started gets this node's workers of its group ended, so torchrun restarts
    the group instead of waiting out the 30-minute collective timeout. 0 turns
    the watch off (for workers that run no Checkpointer watchdog).

With --no-python or --run-path the workers are started as given (no launcher,
no watch). A SIGTERM or SIGINT sent to ftkit run is passed on to torchrun as
SIGTERM (the workers' final save), as is ftkit run's own death (a SIGKILL; Linux);
a terminal's Ctrl-C reaches torchrun itself.
Exits with torchrun's exit code."""


def cmd_run(argv: list[str]) -> int:
    """`ftkit run ARGV`: torchrun with the defaults above; torchrun's exit code."""
    if not argv or argv[0] in ("-h", "--help"):
        print(RUN_HELP)
        return EXIT_OK if argv else EXIT_USAGE
    try:
        p = plan(argv)
    except UsageError as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    for note in p.notes:
        print(f"ftkit run: {note}", file=sys.stderr)
    try:
        if p.launched:  # (else torchrun reports the command line's error: nothing to record)
            os.makedirs(p.run_dir, exist_ok=True)
    except OSError as e:
        print(f"ftkit: error: --run-dir {p.run_dir}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    env = {**os.environ, "FTKIT_RUN_DIR": os.path.abspath(p.run_dir)}
    watch_dir = None
    with contextlib.ExitStack() as cleanup:  # (undone in reverse)
        if p.launched and p.startup_timeout_s > 0:
            env[STARTUP_DIR_ENV] = watch_dir = _startup_dir(cleanup)
        if p.launched and p.warm:
            zygote = start_zygote(env=env, preload=p.preload)
            cleanup.callback(zygote.stop)
            env.update(zygote.env())
            if p.replace_dead:
                env[REPLACE_ENV] = str(p.replace_dead)
        elif p.replace_dead:
            print(
                "ftkit run: --replace-dead needs warm starts (no --cold, --no-python or --run-path); off",
                file=sys.stderr,
            )
        # torchrun's own main, its agent cold (started once per job), one slow logging helper replaced
        cmd = torchrun_command(None, p.torchrun_args)
        print(f"ftkit run: torchrun {' '.join(p.torchrun_args)}  (events in {p.run_dir})", file=sys.stderr, flush=True)
        # Should ftkit run be SIGKILLed (an OOM kill), torchrun gets SIGTERM (the workers' final save)
        # instead of running on unsupervised. (cmd_run runs on the main thread, which lives as long.)
        proc = subprocess.Popen(cmd, env=env, preexec_fn=pdeathsig_preexec())
        if watch_dir:
            cleanup.callback(StartupWatch(proc.pid, watch_dir, p.startup_timeout_s, env["FTKIT_RUN_DIR"]).start().stop)

        # A SIGTERM or SIGINT sent to ftkit run is passed on as SIGTERM: the workers' final save.
        # A Ctrl-C reaches torchrun directly (our terminal's foreground process group): not sent twice.
        def stop_job(signum: int, _frame: object) -> None:
            if signum == signal.SIGTERM or not _in_terminal_foreground():
                proc.send_signal(signal.SIGTERM)

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, stop_job)
            # (None: a handler set outside Python, which cannot be put back; the default is the closest)
            cleanup.callback(signal.signal, signum, signal.SIG_DFL if previous is None else previous)
        rc = proc.wait()
        return 128 - rc if rc < 0 else rc  # killed by signal N: the shell's 128 + N, not 256 - N


def _startup_dir(cleanup: contextlib.ExitStack) -> str:
    """A new directory for the workers' startup reports, locked (flock) while this process lives
    and removed by `cleanup`; first removes those whose ftkit run is gone (SIGKILLed: no cleanup ran)."""
    for held in glob.glob(os.path.join(tempfile.gettempdir(), "ftkit-run-*", "held")):
        with contextlib.suppress(OSError):
            fd = os.open(os.path.dirname(held), os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (OSError: its ftkit run holds it)
                shutil.rmtree(os.path.dirname(held), ignore_errors=True)
            finally:
                os.close(fd)
    directory = tempfile.mkdtemp(prefix="ftkit-run-")
    fd = os.open(directory, os.O_RDONLY)
    cleanup.callback(os.close, fd)
    fcntl.flock(fd, fcntl.LOCK_EX)
    open(os.path.join(directory, "held"), "w").close()  # only now may another ftkit run look at it
    cleanup.callback(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _in_terminal_foreground() -> bool:
    """Whether this process is in its controlling terminal's foreground process group (a SIGINT is then a Ctrl-C)."""
    try:
        with open("/dev/tty", "rb", buffering=0) as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp()
    except OSError:  # no controlling terminal
        return False
