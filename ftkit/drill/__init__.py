"""Failure-injection drills: prove that a setup recovers, with nothing lost.

    ftkit drill [--nproc 4] [--steps 400] [--faults SPEC | --seed N] [--tiers ram,peer,disk|s3|URL]
                [--script PATH [-- ARGS]] [--run-dir DIR] [--json FILE] [--html FILE]

schedule.py  the fault language (pure)
job.py       torchrun under drill, fault points, the injectors
verify.py    faults matched to recoveries; states and checkpoints checked
run.py       the order of a drill, its reports
cli.py       the command line and the printed summary
reference.py the trainer a drill runs; it registers faults.py's faulty:// with fsspec (faults.register)
s3server.py  the drill's own S3 server (SeaweedFS) for --tiers ...,s3; also scripts/s3_server.py
"""

from ftkit.drill.cli import main
from ftkit.drill.run import DEFAULT_FAULTS, run_drill
from ftkit.drill.schedule import Fault, parse_faults, random_faults

__all__ = ["DEFAULT_FAULTS", "Fault", "main", "parse_faults", "random_faults", "run_drill"]
