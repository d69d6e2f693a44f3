"""An "unmodified" trainer for tests/drills/test_unmodified_trainer.py: it never imports
ftkit.coord.dist and forms its group with plain ``dist.init_process_group("gloo")``.

It trains a replicated tensor through real all_reduces (step s adds
s * (1 + 2 + ... + W) to every element), snapshots every step with a
Checkpointer, and rank 0 writes the final tensor and step to --final-out.

``--import-ftkit late`` imports ftkit only after the group exists (only
``ftkit run``'s launcher can then protect its restarts). Faults, each
``KIND:ATTEMPT:RANK`` (ATTEMPT = torchrun's restart count), fire at that
attempt only; they are placed on purpose where the previous attempt's
rendezvous keys would be read:

* kill-step:A:R:S   SIGKILL at step S, once step S-1 is committed on disk
* kill-forming:A:R  enter init_process_group and SIGKILL itself 1 s later, while
                    the group cannot be complete: rank 0 holds back (below)
* hold:A:R          wait until every kill-forming rank of this attempt is inside
                    init_process_group, then never enter it (torchrun ends us)
* late:A:R          enter init_process_group only 2 s after every other rank
                    did: the others must not read a previous attempt's
                    address of this rank
* hang:A:R:PHASE    hang for good before init_process_group (PHASE "init"), or
                    after it and before the Checkpointer while the others wait
                    in a broadcast (PHASE "collective")
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def _parse_faults(specs: list[str]) -> list[tuple[str, int, int, str]]:
    out = []
    for s in specs:
        kind, attempt, rank, *arg = s.split(":")
        out.append((kind, int(attempt), int(rank), arg[0] if arg else ""))
    return out


def _mark(marks: str, name: str) -> None:
    open(os.path.join(marks, name), "w").close()


def _wait_marks(marks: str, names: list[str]) -> None:
    while not all(os.path.exists(os.path.join(marks, n)) for n in names):
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--final-out", required=True)
    p.add_argument("--marks", required=True, help="a directory for the faults' rendezvous files")
    p.add_argument("--import-ftkit", choices=("early", "late"), default="early")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    faults = [f for f in _parse_faults(args.fault) if f[1] == attempt]
    mine = {kind: arg for kind, _, r, arg in faults if r == rank}
    if args.import_ftkit == "early":
        import ftkit  # noqa: F401  (before the group: ftkit's env:// rendezvous applies)

    # ------------------------------------------------------- the group forms
    tag = f"a{attempt}"
    if "hang" in mine and mine["hang"] == "init":
        while True:
            time.sleep(1)
    if "hold" in mine:
        _wait_marks(args.marks, [f"{tag}-forming-{r}" for k, _, r, _ in faults if k == "kill-forming"])
        while True:  # its peers die forming the group; torchrun then ends this worker
            time.sleep(1)
    if "late" in mine:
        _wait_marks(args.marks, [f"{tag}-forming-{r}" for r in range(world) if r != rank])
        time.sleep(2.0)
    if "kill-forming" in mine:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    _mark(args.marks, f"{tag}-forming-{rank}")
    dist.init_process_group("gloo")
    if "hang" in mine and mine["hang"] == "collective":
        while True:
            time.sleep(1)
    flag = torch.zeros(1)
    dist.broadcast(flag, 0)  # the others wait here for a rank that hangs above

    import ftkit  # noqa: F811  (late: the group already exists)

    w = torch.zeros(4, dtype=torch.float64)
    with ftkit.Checkpointer({"w": w}, [args.ckpt]) as ck:
        start = ck.restore()
        for step in range(start + 1, args.steps + 1):
            if "kill-step" in mine and step == int(mine["kill-step"]):
                manifest = os.path.join(args.ckpt, f"step-{step - 1:012d}", "manifest.json")
                while not os.path.exists(manifest):
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.full((4,), float(step * (rank + 1)), dtype=torch.float64)
            dist.all_reduce(g)
            w += g
            ck.snapshot(step)
            time.sleep(args.step_time)
    if rank == 0:
        torch.save({"w": w, "step": args.steps, "start": start}, args.final_out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
