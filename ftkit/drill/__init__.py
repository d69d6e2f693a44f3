"""Failure-injection drills: prove that a setup recovers, with nothing lost.

    ftkit drill [--nproc 4] [--steps 400] [--faults SPEC | --seed N] [--tiers ram,peer,disk|s3|URL]
                [--script PATH [-- ARGS]] [--run-dir DIR] [--json FILE] [--html FILE]

schedule.py  the fault language (pure)
job.py       torchrun under drill, fault points, the injectors
verify.py    faults matched to recoveries; states and checkpoints checked
run.py       the order of a drill, its reports
cli.py       the command line and the printed summary
"""

import fsspec

# The drills' fault-injecting filesystem (faults.py), as faulty:// for fsspec: registered where a
# drill runs (this package: its CLI, its reference trainer, the tests that inject storage faults),
# not for every user of fsspec on the machine, as an installed entry point would be.
fsspec.register_implementation("faulty", "ftkit.drill.faults.FaultyFileSystem", clobber=True)

from ftkit.drill.cli import main  # noqa: E402
from ftkit.drill.run import DEFAULT_FAULTS, run_drill  # noqa: E402
from ftkit.drill.schedule import Fault, parse_faults, random_faults  # noqa: E402

__all__ = ["DEFAULT_FAULTS", "Fault", "main", "parse_faults", "random_faults", "run_drill"]
