"""A DDP or FSDP2 trainer recovering in process (ftkit.run_in_process), run under torchrun (gloo, CPU).

    torchrun --nproc-per-node 2 tests/support/inprocess_trainer.py --parallel ddp|fsdp --steps 12 --out DIR \
        [--crash RANK:STEP] [--kill RANK:STEP] [--stop RANK:STEP] [--slow RANK:STEP:SECONDS]
        [--device cuda --backend gloo|nccl]

Every step snapshots to the node's RAM tier. --crash makes RANK raise at STEP of the
first generation of torchrun's first attempt; the job then goes on in process. --kill makes
RANK SIGKILL itself there instead (under FTKIT_REPLACE_DEAD its warm client replaces it), --stop
SIGSTOP itself (a hang: the watchdog kills it, then it is replaced). --slow makes
RANK a straggler from STEP on in that generation (SECONDS more of compute a step) and has
the watchdog abort stragglers, so its verdict, not an exception, starts the recovery.
--device cuda trains on the GPU (DDP; rank r on GPU r mod the count); each call also
records a CUDA tensor made before the first generation, to show the context was kept. Rank 0 writes the final full
model and optimizer tensors to DIR/final.pt; every rank appends one JSON line per
call of the training function (pid, generation, the step restored) to DIR/calls.jsonl.
With two ranks every all-reduce and reduce-scatter is one addition of two values,
the same in any order, so the final state equals a fault-free run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ftkit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_worker import build, full_state  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parallel", default="ddp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--crash", default="", help="RANK:STEP")
    p.add_argument("--kill", default="", help="RANK:STEP")
    p.add_argument("--stop", default="", help="RANK:STEP")
    p.add_argument("--slow", default="", help="RANK:STEP:SECONDS")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="gloo")
    args = p.parse_args()
    torch.set_num_threads(1)
    crash = tuple(int(v) for v in args.crash.split(":")) if args.crash else None
    kill = tuple(int(v) for v in args.kill.split(":")) if args.kill else None
    stop = tuple(int(v) for v in args.stop.split(":")) if args.stop else None
    slow_rank, slow_from, slow_s = (float(v) for v in args.slow.split(":")) if args.slow else (-1, 0, 0.0)
    watchdog = ftkit.WatchdogConfig(straggler_action="abort") if args.slow else True
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    device = args.device
    anchor = None
    if device == "cuda":
        device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        anchor = torch.arange(4.0, device=device)  # lives across generations: the context must too

    def train(gen: ftkit.Generation) -> dict:
        rank = dist.get_rank()
        model, opt = build(args.parallel, seed=1, device=device)  # everything that holds the group, built again
        with ftkit.Checkpointer({"model": model, "optim": opt}, [ftkit.Tier("ram")], watchdog=watchdog) as ck:
            start = ck.restore()
            with open(os.path.join(args.out, "calls.jsonl"), "a") as f:
                f.write(
                    json.dumps(
                        {
                            "rank": rank,
                            "pid": os.getpid(),
                            "gen": gen.number,
                            "restored": start,
                            "reason": gen.reason,
                            "anchor": None if anchor is None else [anchor.data_ptr(), anchor.tolist()],
                        }
                    )
                    + "\n"
                )
            for step in range(start + 1, args.steps + 1):
                g = torch.Generator().manual_seed(step * 100 + rank)
                if (rank, gen.number) == (slow_rank, 0) and step >= slow_from and first_attempt:
                    time.sleep(slow_s)  # a slow rank's compute (before its first gradient)
                loss = model(torch.randn(8, 16, generator=g).to(device)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if crash == (rank, step) and gen.number == 0 and first_attempt:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step}")
                if kill == (rank, step) and gen.number == 0 and first_attempt:
                    os.kill(os.getpid(), signal.SIGKILL)
                if stop == (rank, step) and gen.number == 0 and first_attempt:
                    os.kill(os.getpid(), signal.SIGSTOP)
                ck.snapshot(step)
        return full_state(model, opt)

    final = ftkit.run_in_process(train, backend=args.backend, recovery_timeout_s=10)
    if dist.get_rank() == 0:
        torch.save(final, os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
