"""The RAM tier: snapshots in the node's shared memory.

A restarted worker on a healthy node finds its snapshots where it left them and
restores at memory speed. Layout: ``<root>/<job>/<node>/step-.../`` where root is
``$FTKIT_RAM_DIR`` or ``/dev/shm/ftkit``, job is ``$FTKIT_JOB_ID``, else torchrun's
``$TORCHELASTIC_RUN_ID``, else ``default``; the job directory is mode 0700 so
only the job's user can read the state. The node component lets tests simulate
several nodes on one machine (and is harmless on real ones).

The node's directory holds the step manifests (copied there by the node's first
rank after rank 0 commits), the node's own ranks' data files, and the replicas
other nodes sent it; a step's files may therefore be spread over nodes, which
the restore planner accounts for.
"""

from __future__ import annotations

import os
import re

RAM_URL = "ram"
PEER_URL = "peer"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def ram_root() -> str:
    return os.environ.get("FTKIT_RAM_DIR") or "/dev/shm/ftkit"


def job_id() -> str:
    return _SAFE.sub("_", os.environ.get("FTKIT_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default")


def job_dir(job: str | None = None) -> str:
    return os.path.join(ram_root(), job or job_id())


def node_dir(node: str, job: str | None = None) -> str:
    """The RAM tier directory of `node`, created 0700 on first use."""
    path = os.path.join(job_dir(job), _SAFE.sub("_", node))
    os.makedirs(job_dir(job), mode=0o700, exist_ok=True)
    os.chmod(job_dir(job), 0o700)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def remove_job(job: str | None = None) -> str:
    """Delete a finished job's RAM tier on this machine; returns the directory removed."""
    import shutil

    path = job_dir(job)
    shutil.rmtree(path, ignore_errors=True)
    return path
