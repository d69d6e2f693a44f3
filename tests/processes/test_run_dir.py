"""Where `ftkit run` puts the event log when the job's environment names the run directory.

hooks/slurm/train.sbatch exports FTKIT_RUN_DIR (runs/<job id>) and starts `ftkit run`
without --run-dir, as a user does who sets FTKIT_RUN_DIR for their Checkpointers
(README, "Events": `$FTKIT_RUN_DIR/events/`). A real `ftkit run` with one worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, run_cli

TRAINER = """
import os, sys, torch, ftkit
with open(sys.argv[2], "w") as f:
    f.write(os.environ["FTKIT_RUN_DIR"])
with ftkit.Checkpointer({"w": torch.zeros(4)}, tiers=[sys.argv[1]], watchdog=False) as ck:
    ck.snapshot(1)
"""


def _ftkit_run(tmp_path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(TRAINER)
    cmd = [sys.executable, "-m", "ftkit", "run", "--cold", "--startup-timeout", "0", "--nproc-per-node", "1"]
    cmd += [*args, str(script), str(tmp_path / "ckpt"), str(tmp_path / "seen")]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **env}
    return subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=120)


def test_ftkit_run_logs_events_in_the_run_dir_the_environment_names(tmp_path):
    run_dir = tmp_path / "runs" / "4242"
    done = _ftkit_run(tmp_path, [], {"FTKIT_RUN_DIR": str(run_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "seen").read_text() == str(run_dir)
    assert (run_dir / "events" / "rank-00000.jsonl").is_file()
    assert not (tmp_path / "ftkit-run").exists()
    assert f"(events in {run_dir})" in done.stderr


def test_ftkit_run_dir_on_the_command_line_wins_over_the_environment(tmp_path):
    env = {"FTKIT_RUN_DIR": str(tmp_path / "from-env")}
    done = _ftkit_run(tmp_path, ["--run-dir", "given"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "seen").read_text() == str(tmp_path / "given")
    assert (tmp_path / "given" / "events" / "rank-00000.jsonl").is_file()
    assert not (tmp_path / "from-env").exists()


PREEMPTED = """
import sys, time, torch, ftkit
run_dir, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {"w": torch.zeros(4)}
with ftkit.Checkpointer(state, tiers=[ckpt], run_dir=run_dir) as ck:
    start = ck.restore()
    for step in range(start + 1, steps + 1):
        state["w"] += 1
        ck.snapshot(step)
        print(step, flush=True)
        time.sleep(0.05)
"""


def test_report_of_a_run_dir_a_requeued_job_launched_twice(tmp_path):
    """hooks/slurm/train.sbatch: SIGTERM, the agreed step saved, the job requeued under the same
    job id and so the same run directory; its second launch is torchrun's attempt 0 again. The
    report counts the time between the launches as an incident, not as training."""
    script, run_dir, ckpt = tmp_path / "train.py", tmp_path / "run", tmp_path / "ckpt"
    script.write_text(PREEMPTED)
    cmd = [sys.executable, str(script), str(run_dir), str(ckpt)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    first = subprocess.Popen([*cmd, "1000"], env=env, stdout=subprocess.PIPE, text=True)
    while int(first.stdout.readline() or 0) < 5:
        pass
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(2.0)  # the job waits in the queue
    second = subprocess.run([*cmd, "10"], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr[-3000:]
    done = run_cli("report", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    saved = report["incidents"][0]["last_step"] if report["incidents"] else None
    assert report["attempts"] == 2 and len(report["incidents"]) == 1, report
    incident = report["incidents"][0]
    assert incident["detected_by"] == "preemption (SIGTERM)" and not incident["in_process"]
    assert incident["resumed_from"] == saved and incident["steps_lost"] == 0
    assert incident["restart_s"] >= 2.0 and report["productive_s"] <= report["wall_s"] - 2.0
    assert report["final_step"] == 10
