"""Failure-injection drills (``ftkit drill``): prove that a setup recovers, with nothing lost.

schedule.py is the fault language, job.py runs torchrun under drill and injects faults, verify.py
matches them to recoveries, run.py orders a drill, cli.py prints it; hostdrill.py, cluster.py,
hosts.py and etcd.py drill over emulated hosts. reference.py is the trainer drilled, faults.py its
faulty:// storage, s3server.py the drill's own S3 server.
"""

from ftkit.drill.cli import main
from ftkit.drill.run import DEFAULT_FAULTS, run_drill
from ftkit.drill.schedule import Fault, parse_faults, random_faults

__all__ = ["DEFAULT_FAULTS", "Fault", "main", "parse_faults", "random_faults", "run_drill"]
