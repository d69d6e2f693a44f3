"""Requeue: after a preemption's final save, ask the scheduler to run the job again.

SLURM warns a job before its time limit with a signal of the user's choice (``sbatch
--signal=USR1@120``); rank 0 then runs ``scontrol requeue <job>`` once, after the final
save is committed or has failed (an earlier snapshot still beats a job that ends for good).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

log = logging.getLogger("ftkit")

_JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


def slurm_job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """The id `scontrol requeue` takes for this job (``<array job>_<task>`` for an array
    task), or None outside SLURM or when the variables do not hold an id (it reaches a command line)."""
    array_job, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{task}" if array_job and task else env.get("SLURM_JOB_ID")
    return job if job and _JOB_ID.fullmatch(job) else None


def requeue(timeout_s: float = 30.0) -> tuple[bool, str]:
    """Ask SLURM to requeue this job: (done, what happened, in one line for the log)."""
    job = slurm_job_id()
    if job is None:
        return False, "not requeued: no SLURM job id in the environment (SLURM_JOB_ID)"
    scontrol = shutil.which("scontrol")
    if scontrol is None or not os.path.isabs(scontrol):  # (not from a relative PATH entry)
        return False, f"job {job} not requeued: scontrol is not on PATH"
    try:
        r = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"job {job} not requeued: scontrol requeue: {e}"
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip().splitlines()
        last = f": {said[-1]}" if said else ""
        return False, f"job {job} not requeued: scontrol requeue exited {r.returncode}{last}"
    return True, f"job {job} requeued"
