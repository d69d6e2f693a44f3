"""What ``ftkit run`` adds to torchrun: its command line (:func:`plan`), and the startup watch.

torchrun stays the launcher and the elastic agent. ``plan`` has it start each worker
through ftkit.runtime.launch (or the warm client). :class:`StartupWatch` SIGKILLs this
node's workers of a group when one has not reached its first heartbeat (a Checkpointer's
watchdog running) within ``--startup-timeout`` s, so torchrun restarts the group instead
of waiting out the collective timeout; it logs a ``detect`` event (``what: "startup"``,
rank -1). The watch is a process outside the workers because a SIGSTOPped worker, or one
stuck in native code holding the GIL, cannot act itself, and SIGKILL is what torchrun
already handles as a failure. Each node's ``ftkit run`` ends only its own workers.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ftkit.errors import UsageError
from ftkit.runtime.generation import torchrun_attempt

RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"  # across hosts, see plan()

DEFAULT_STARTUP_TIMEOUT_S = 600.0
STARTED_UP = ("heartbeat", "single")


class _Unparsable(Exception):
    pass


@dataclass
class Plan:
    """What ftkit run will start: torchrun's arguments and its own settings."""

    torchrun_args: list[str]
    run_dir: str = "ftkit-run"
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    launched: bool = True  # workers start through ftkit.runtime.launch
    warm: bool = True  # ... forked from a zygote (ftkit/runtime/warm), torchrun starting their thin clients
    preload: tuple[str, ...] = ()  # modules the zygote imports besides torch and ftkit
    replace_dead: int = 0  # times a warm client may replace its killed worker (ftkit/runtime/warm/client.py)
    notes: list[str] = field(default_factory=list)


class _Record(argparse.Action):
    """Store the value (True for a flag, nargs=0), and remember the option as typed and whether
    it takes a value (to take it out of torchrun's arguments)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values if self.nargs != 0 else True)
        namespace.ftkit_typed[option_string] = self.nargs != 0


def default_run_dir() -> str:
    """--run-dir when none is given: $FTKIT_RUN_DIR (a batch script's, hooks/slurm/train.sbatch), else ./ftkit-run."""
    return os.environ.get("FTKIT_RUN_DIR") or "ftkit-run"


FTKIT_OPTIONS = ("--run-dir", "--startup-timeout", "--cold", "--preload", "--replace-dead")


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.add_argument("--run-dir", action=_Record, default=None)  # None: default_run_dir()
    p.add_argument("--startup-timeout", action=_Record, type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    p.add_argument("--cold", action=_Record, nargs=0, default=False)
    p.add_argument("--preload", action=_Record, default="")
    p.add_argument("--replace-dead", action=_Record, type=int, default=0)

    def fail(message: str = "", *_a: Any) -> NoReturn:
        raise _Unparsable(message)

    p.error = fail  # torchrun reports its own usage errors
    p.exit = lambda status=0, message=None: fail(message or "")
    p.print_help = lambda file=None: None
    return p


def _strip(tokens: list[str], typed: dict[str, bool]) -> list[str]:
    """`tokens` without the options `typed` ({option: whether it takes a value}) and their values."""
    out, skip = [], False
    for t in tokens:
        if skip:
            skip = False
        elif t in typed:
            skip = typed[t]
        elif not any(t.startswith(o + "=") for o in typed):
            out.append(t)
    return out


def plan(argv: list[str]) -> Plan:
    """Split `ftkit run` arguments into ftkit's and torchrun's, and rewrite the latter."""
    ns = argparse.Namespace(ftkit_typed={})
    try:
        ns = _parser().parse_args(argv, namespace=ns)
    except _Unparsable as e:
        if any(f"argument {o}" in str(e) for o in FTKIT_OPTIONS):  # one of ours: say it here
            raise UsageError(str(e)) from None
        # torchrun will say what is wrong; without a script there is nothing to rewrite
        return Plan(list(argv), default_run_dir(), launched=False)
    script_at = len(argv) - len(ns.training_script_args) - 1
    options = _strip(argv[:script_at], ns.ftkit_typed)
    script = [ns.training_script, *ns.training_script_args]
    if ns.startup_timeout < 0:
        raise UsageError("--startup-timeout must be 0 (off) or a number of seconds")
    preload = tuple(m for m in ns.preload.split(",") if m)
    if ns.replace_dead < 0:
        raise UsageError("--replace-dead must be 0 (off) or a number of replacements per worker")
    if not (ns.no_python or ns.run_path or ns.module) and not os.path.isfile(ns.training_script):
        # (torchrun would start it anyway, and restart it with a traceback every time)
        raise UsageError(f"no such script: {ns.training_script}")
    run_dir = default_run_dir() if ns.run_dir is None else ns.run_dir
    out = Plan([], run_dir, ns.startup_timeout, warm=not ns.cold, preload=preload, replace_dead=ns.replace_dead)
    names = {o.split("=", 1)[0].replace("_", "-") for o in options if o.startswith("--")}
    defaults = []
    if "--max-restarts" not in names:
        defaults += ["--max-restarts", "3"]
    if "--monitor-interval" not in names:
        defaults += ["--monitor-interval", "0.5"]
    if not names & {"--standalone", "--rdzv-endpoint", "--nnodes", "--master-addr"}:
        defaults.append("--standalone")
    elif names & {"--rdzv-endpoint", "--nnodes"} and "--rdzv-conf" not in names and "--standalone" not in names:
        # Across hosts: drop a lost host and close a round sooner (docs/operations.md, "Across hosts").
        defaults += ["--rdzv-conf", RDZV_CONF]
        out.notes.append(f"rendezvous timing --rdzv-conf {RDZV_CONF} (give --rdzv-conf to choose your own)")
    if ns.no_python or ns.run_path:
        out.launched = False
        out.notes.append(
            "with --no-python or --run-path the workers do not start through ftkit.runtime.launch: "
            "restarts are safe only if the script imports ftkit before init_process_group, "
            "and the startup watch is off"
        )
        out.warm = False
        out.torchrun_args = [*defaults, *options, *script]
    elif out.warm:  # torchrun runs `python -u .../ftkit/runtime/warm/client.py [--module] SCRIPT ARGS`
        from ftkit.runtime.warm.zygote import client_path

        module = ["--module"] if ns.module else []
        plain = [o for o in options if o not in ("-m", "--module")]
        out.torchrun_args = [*defaults, *plain, client_path(), *module, *script]
    elif ns.module:  # torchrun runs `python -m ftkit.runtime.launch --module MODULE ARGS`
        out.torchrun_args = [*defaults, *options, "ftkit.runtime.launch", "--module", *script]
    else:  # torchrun runs `python -m ftkit.runtime.launch SCRIPT ARGS`
        out.torchrun_args = [*defaults, *options, "-m", "ftkit.runtime.launch", *script]
    return out


# ------------------------------------------------------------ startup watch
class StartupWatch:
    """SIGKILLs this node's worker group when a worker is not started up within `bound_s`.

    Polls torchrun's children every `interval_s` and the status files launch.py writes to `status_dir`.
    """

    interval_s = 0.5

    def __init__(self, agent_pid: int, status_dir: str, bound_s: float, run_dir: str):
        self.agent_pid = agent_pid
        self.status_dir = status_dir
        self.bound_s = bound_s
        self.run_dir = run_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftkit-startup-watch", daemon=True)
        # (pid, create time) -> since when (monotonic) its worker has been starting, and that worker's
        # pid once its status file names it: a replacement (--replace-dead) starts the clock again
        self._seen: dict[tuple[int, float], tuple[float, int | None]] = {}
        self._ended: set[tuple[int, float]] = set()

    def start(self) -> StartupWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import psutil

        try:
            agent = psutil.Process(self.agent_pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.wait(self.interval_s):
            try:
                self.check(agent)
            except psutil.NoSuchProcess:  # torchrun is gone
                return
            except Exception as e:  # never let the watch take ftkit run down
                print(f"ftkit run: startup watch error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def check(self, agent) -> None:
        """One look at the workers; end their group if one is late."""
        import psutil

        now = time.monotonic()
        workers, late = [], []
        for child in agent.children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                key = (child.pid, child.create_time())
            except psutil.NoSuchProcess:
                continue
            if key in self._ended:
                continue
            workers.append((key, child))
            status = self._status(*key)
            since, worker = self._seen.setdefault(key, (now, None))
            if isinstance(status.get("worker"), int) and status["worker"] != worker:
                since = since if worker is None else now  # another worker behind the same client
                self._seen[key] = (since, status["worker"])
            waited = now - since
            if status.get("phase") not in STARTED_UP and waited > self.bound_s:
                late.append((child, status, waited))
        if late:
            self._end_group(workers, late)

    def _status(self, pid: int, created: float) -> dict:
        try:
            with open(os.path.join(self.status_dir, f"{pid}.json")) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return {}
        return doc if doc.get("t", 0) >= created - 1 else {}  # else: a previous process with this pid

    def _end_group(self, workers: list, late: list) -> None:
        import psutil

        for proc, status, waited in late:
            rank, attempt = status.get("rank"), status.get("attempt")
            if rank is None or attempt is None:
                try:
                    env = proc.environ()
                    rank, attempt = env.get("RANK"), torchrun_attempt(env)
                except (psutil.Error, OSError):
                    pass
            phase = {
                "started": "it had not formed the process group",
                "group": "the process group had formed; no Checkpointer watchdog yet",
            }.get(status.get("phase"), "it had not even reached ftkit.runtime.launch")
            why = f"no first heartbeat within {self.bound_s:g}s of its start ({phase})"
            print(
                f"ftkit run: rank {rank} (pid {proc.pid}, attempt {attempt}): {why}; ending this node's "
                f"workers of the group so torchrun restarts it",
                file=sys.stderr,
                flush=True,
            )
            event = {
                "t": time.time(),
                "rank": -1,
                "attempt": _int(attempt),
                "event": "detect",
                "what": "startup",
                "target": _int(rank),
                "pid": proc.pid,
                "latency_s": waited,
                "why": why,
            }
            self._log(event)
        for key, proc in workers:
            self._ended.add(key)
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()  # psutil checks it is still that process (pid reuse)

    def _log(self, event: dict) -> None:
        try:
            os.makedirs(os.path.join(self.run_dir, "events"), exist_ok=True)
            with open(os.path.join(self.run_dir, "events", "ftkit-run.jsonl"), "a") as f:
                f.write(json.dumps(event) + "\n")
        except OSError as e:
            print(f"ftkit run: cannot write the event log: {e}", file=sys.stderr, flush=True)


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def pdeathsig_preexec():
    """A Popen preexec_fn making the kernel SIGTERM the child when this process dies (no orphan), or None.
    Linux, main thread only: PR_SET_PDEATHSIG fires when the forking *thread* exits, so a child
    started from a short-lived thread would die with it.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # parent already died before prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
