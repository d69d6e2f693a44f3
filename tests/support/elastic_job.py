"""An elastic job for tests/drills/test_elastic.py, run by torchrun agents (one per simulated node).

Data-parallel over gloo with a fixed per-rank batch; the data position is ftkit's
ResumableDistributedSampler (the global sample position), so when a restart
comes back with fewer ranks the job goes on with the same global stream. Each
step's samples go to the event log ("batch" events), for the test to check.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

import ftkit
from ftkit.coord.dist import init_process_group

N_SAMPLES, BATCH = 64, 2


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--final-out", required=True, help="rank 0 writes the final weights here")
    args = p.parse_args()
    torch.set_num_threads(1)
    init_process_group("gloo", timeout_s=60)
    world = dist.get_world_size()
    torch.manual_seed(0)
    data = torch.randn(N_SAMPLES, 16)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = ftkit.ResumableDistributedSampler(N_SAMPLES, seed=7)
    state = {"model": model, "optim": opt, "sampler": sampler}
    tiers = [ftkit.Tier("ram", replicas=1), ftkit.Tier(args.ckpt, every=1000)]
    with ftkit.Checkpointer(state, tiers, run_dir=args.run_dir) as ck:
        step = ck.restore()
        while step < args.steps:
            sampler.set_epoch(sampler.epoch)
            batch: list[int] = []
            for i in sampler:
                batch.append(i)
                if len(batch) < BATCH:
                    continue
                model(data[batch]).square().mean().backward()
                for p_ in model.parameters():
                    dist.all_reduce(p_.grad)
                    p_.grad.div_(world)
                opt.step()
                opt.zero_grad()
                sampler.advance(len(batch))
                step += 1
                ck.events.emit("batch", step=step, samples=batch, world_size=world)
                ck.snapshot(step)
                time.sleep(args.step_time)
                batch = []
                if step == args.steps:
                    break
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "world_size": world}, args.final_out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
