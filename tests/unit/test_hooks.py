"""hooks/prestop.sh's pattern for the launcher it signals, checked with POSIX extended
regular expressions (grep -E: what pgrep -f matches with) on command lines as ps shows them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

PRESTOP = Path(__file__).resolve().parents[2] / "hooks" / "prestop.sh"

LAUNCHERS = [
    "/venv/bin/python3 /venv/bin/ftkit run --nproc-per-node 2 train.py",
    "ftkit run train.py",
    "python -m ftkit run train.py",
    "/usr/bin/python3 -X faulthandler -m ftkit run train.py",
    "python3 -u -W ignore -m ftkit run train.py",
    "/venv/bin/torchrun --nproc-per-node 8 train.py",
    "python -m torch.distributed.run --nproc-per-node 8 train.py",
]
NOT_LAUNCHERS = [
    "/venv/bin/python3 -u train.py --local-rank 0",  # a worker: signalled through its launcher
    "python -m ftkit.drill.zygote --preload torchrun",  # names torchrun in an argument
    "python train.py --launcher torchrun",
    "python -m ftkit.runtime.warm.client run",
    "python -X faulthandler train.py ftkit run",
]


def _pattern() -> str:
    (line,) = [x for x in PRESTOP.read_text().splitlines() if x.startswith("job=")]
    return re.fullmatch(r"job='(.*)'", line).group(1)


@pytest.mark.parametrize("command", LAUNCHERS + NOT_LAUNCHERS)
def test_prestop_signals_the_launcher_and_nothing_else(command):
    found = subprocess.run(["grep", "-Eq", _pattern()], input=command, text=True).returncode == 0
    assert found == (command in LAUNCHERS), command
