"""Failure-injection drills: prove that a setup recovers, with nothing lost.

    ftkit drill [--nproc 4] [--steps 400] [--faults SPEC | --seed N] [--tiers ram,peer,disk|s3|URL]
                [--script PATH [-- ARGS]] [--run-dir DIR] [--json FILE] [--html FILE]

schedule.py  the fault language (pure)
job.py       torchrun under drill, fault points, the injectors
verify.py    faults matched to recoveries; states and checkpoints checked
run.py       the order of a drill, its reports
cli.py       the command line and the printed summary
"""

from ftkit.drill.cli import main
from ftkit.drill.run import DEFAULT_FAULTS, run_drill
from ftkit.drill.schedule import Fault, parse_faults, random_faults

__all__ = ["DEFAULT_FAULTS", "Fault", "main", "parse_faults", "random_faults", "run_drill"]
