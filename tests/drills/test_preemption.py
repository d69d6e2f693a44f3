"""Preemption: SIGTERM saves the current step to the durable tier, and a new job resumes from it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, warm_target
from torchrun_job import Job, stop_everything

import ftkit
from ftkit.format.reader import committed_steps


def _trainer(zygote, ckpt, final, steps=60, extra=()):
    """The reference trainer as one process, forked warm from `zygote` through its thin client
    (signals and the exit code pass through it as they would from the process itself)."""
    return [
        sys.executable,
        "-u",
        *warm_target(zygote, ["-m", "ftkit.drill.reference"]),
        "--ckpt",
        str(ckpt),
        "--steps",
        str(steps),
        "--every",
        "1000",
        "--step-time",
        "0.05",
        "--final-out",
        str(final),
        *extra,
    ]


def test_sigterm_saves_to_the_durable_tier_and_a_new_run_resumes_exactly(tmp_path, zygote):
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, **zygote.env()}
    proc = subprocess.Popen(
        _trainer(zygote, ckpt, tmp_path / "a.pt"), stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    for line in proc.stdout:
        if line.startswith("step 12 "):
            proc.send_signal(signal.SIGTERM)
            break
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    steps = committed_steps(ftkit.Tier(str(ckpt)).open())
    assert len(steps) == 1 and 12 <= steps[0] <= 14  # nothing was due (every=1000): the flush made it
    # A new job resumes from it and ends where an uninterrupted run ends.
    r = subprocess.run(
        _trainer(zygote, ckpt, tmp_path / "resumed.pt"), capture_output=True, text=True, cwd=REPO, env=env
    )
    assert r.returncode == 0 and f"resumed from step {steps[0]}" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        _trainer(zygote, tmp_path / "clean", tmp_path / "clean.pt"), capture_output=True, cwd=REPO, env=env
    )
    assert r.returncode == 0
    a, b = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "clean.pt")
    assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items())


def test_sigterm_to_torchrun_flushes_every_rank(tmp_path, zygote):
    job = Job(
        tmp_path, zygote=zygote, steps=200, extra=("--ram", "--every", "1000", "--step-time", "0.05"), max_restarts=0
    )
    try:
        job.wait_for_step(8)
        job.proc.send_signal(signal.SIGTERM)  # to the agent, as a scheduler would
        job.wait(timeout=90)
    finally:
        stop_everything(job)
    manifest = ftkit.format.reader.newest_manifest(ftkit.Tier(str(tmp_path / "ckpt")).open())
    assert manifest.world_size == 4 and manifest.step >= 8
    flushes = [e for e in job.events() if e["event"] == "preempt_flush"]
    assert len(flushes) == 4 and all(e["ok"] and e["step"] == manifest.step for e in flushes)


def test_a_preemption_heard_by_a_training_loop_on_a_thread_still_ends_its_process(tmp_path):
    """Rank 0 trains on a thread (its main thread waits, as a framework's driver may); rank 1
    gets SIGTERM. Both save the agreed step and exit 143: rank 0's SystemExit ended its thread
    only, and the process exited 0 as if training had finished."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = os.path.join(REPO, "tests", "support", "thread_preempt.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), port, str(tmp_path)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, outs
    assert all("saved to every tier" in o for o in outs), outs


def test_sigint_or_sigkill_to_ftkit_run_alone_saves_as_sigterm_does(tmp_path):
    """A SIGINT sent to ftkit run alone (not a terminal's Ctrl-C, which reaches torchrun too) ends the
    job as a SIGTERM does, through the same handler (SIGTERM: the prestop test below); it was ignored.
    A SIGKILL (an OOM kill) of ftkit run alone gets torchrun SIGTERM from the kernel: the job saves and
    ends instead of running on unsupervised; the next ftkit run removes its startup directory."""
    import psutil

    from ftkit.runtime.run import _startup_dir

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {}
    for how in ("int", "kill"):  # two jobs at once (CI time)
        cmd = [sys.executable, "-m", "ftkit", "run", "--run-dir", str(tmp_path / how), "--nproc-per-node", "2"]
        cmd += ["--max-restarts", "0", "-m", "ftkit.drill.reference", "--ckpt", str(tmp_path / how / "ckpt")]
        cmd += ["--steps", "2000", "--every", "1000", "--step-time", "0.05"]
        with open(tmp_path / f"{how}.log", "w") as log:
            # (a session of its own: no terminal whose foreground it shares, as under a scheduler)
            procs[how] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
    try:
        for how in procs:
            events = tmp_path / how / "events" / "rank-00001.jsonl"
            for _ in range(600):
                if events.exists() and '"event": "step"' in events.read_text():
                    break
                time.sleep(0.2)
        job = psutil.Process(procs["kill"].pid).children(recursive=True)  # zygote, torchrun, workers
        startup_dir = job[0].environ()["FTKIT_STARTUP_DIR"]  # (the zygote's or torchrun's)
        procs["int"].send_signal(signal.SIGINT)  # to ftkit run alone
        procs["kill"].kill()  # ftkit run alone
        rc = procs["int"].wait(timeout=90)

        def running(p: psutil.Process) -> bool:  # (orphans: reaped by init, or zombies where init does not reap)
            with contextlib.suppress(psutil.NoSuchProcess):
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            return False

        for _ in range(450):
            if not any(map(running, job)):
                break
            time.sleep(0.2)
        left = [p.cmdline() for p in job if running(p)]
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # (torchrun and its workers too, even orphaned)
            proc.wait()
    out = (tmp_path / "int.log").read_text()
    assert rc == 128 + signal.SIGTERM and "Traceback" not in out, out
    assert not left, [*left, (tmp_path / "kill.log").read_text()]
    for how in ("int", "kill"):
        steps = committed_steps(ftkit.Tier(str(tmp_path / how / "ckpt")).open())
        assert len(steps) == 1 and steps[0] >= 1, how  # nothing was due (every=1000): the signal saved it
    assert os.path.isdir(startup_dir)
    with contextlib.ExitStack() as cleanup:
        _startup_dir(cleanup)
    assert not os.path.exists(startup_dir)


# hooks/prestop.sh inside a private PID namespace, where the only job is the one started here
# (the hook signals every job of its container; the host runs other tests' jobs).
_JOB_THEN_HOOK = """
ftkit() { "$PY" -m ftkit "$@"; }
ftkit run --run-dir "$D/run" --nproc-per-node 2 --monitor-interval 0.1 --max-restarts 0 \\
    -m ftkit.drill.reference --ckpt "$D/ckpt" --steps 2000 --every 1000 --step-time 0.05 \\
    > "$D/job.log" 2>&1 &
job=$!
waited=0
until grep -qs '"event": "step"' "$D/run/events/rank-00001.jsonl"; do
    sleep 0.2
    waited=$((waited + 1))
    [ "$waited" -lt 600 ] || { echo "no step"; kill -KILL $job; exit 1; }
done
sh hooks/prestop.sh 90
echo "hook $?"
wait $job
echo "job $?"
"""


def _private_pid_namespace() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_the_prestop_hook_makes_an_ftkit_run_job_save_and_exit_143(tmp_path):
    if not _private_pid_namespace():
        pytest.skip("needs `unshare --pid --fork --mount-proc` (root)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PY": sys.executable, "D": str(tmp_path)}
    r = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", _JOB_THEN_HOOK],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=240,
    )
    log = (tmp_path / "job.log").read_text() if (tmp_path / "job.log").exists() else ""
    assert r.stdout.split() == ["hook", "0", "job", str(128 + signal.SIGTERM)], r.stdout + r.stderr + log
    assert "Traceback" not in log, log
    steps = committed_steps(ftkit.Tier(str(tmp_path / "ckpt")).open())
    assert len(steps) == 1 and steps[0] >= 1, log  # nothing was due (every=1000): the hook's SIGTERM saved it
