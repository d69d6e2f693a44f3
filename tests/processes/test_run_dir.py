"""Where `ftkit run` puts the event log when the job's environment names the run directory.

hooks/slurm/train.sbatch exports FTKIT_RUN_DIR (runs/<job id>) and starts `ftkit run`
without --run-dir, as a user does who sets FTKIT_RUN_DIR for their Checkpointers
(README, "Events": `$FTKIT_RUN_DIR/events/`). A real `ftkit run` with one worker.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

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
