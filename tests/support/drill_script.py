"""A user's own training script, as `ftkit drill --script` runs it under torchrun.

Nothing here knows about drills: it trains a small model data-parallel, takes
ftkit snapshots every step to RAM with peer replicas and every 5 steps to
--ckpt, and resumes from the newest one on start.
"""

import argparse
import time

import torch
import torch.distributed as dist

import ftkit
from ftkit.coord.dist import init_process_group


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-time", type=float, default=0.05)
    a = p.parse_args()
    init_process_group("gloo")  # torchrun restarts need it on torch 2.13 (see ftkit.coord.dist)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with ftkit.Checkpointer(state, [ftkit.Tier("ram", replicas=1), ftkit.Tier(a.ckpt, every=5)]) as ck:
        for step in range(ck.restore() + 1, a.steps + 1):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
            opt.step()
            ck.snapshot(step)
            time.sleep(a.step_time)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
