"""The reference trainer: a small deterministic GPT-style model on CPU.

The drills and the demo (scripts/demo.py) run it because it is bit-for-bit reproducible, so a run
that was killed and restored can be compared exactly with one that never failed. It restores the
newest snapshot on start and snapshots every step; the batch of step N on rank R comes from
(seed, N, R), so the data position is the step itself.

    torchrun --nproc-per-node 4 -m ftkit.drill.reference --ckpt DIR --ram --peer 1 --steps 30
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

import torch
import xxhash
from torch import nn

import ftkit
from ftkit.drill.faults import register as register_faulty
from ftkit.format.codec import allow_skipping_checksums


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        mask: torch.Tensor = self.mask  # a registered buffer
        h = self.blocks(h, mask=mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batch_for(step: int, seed: int, batch: int = 8, seq: int = 32, vocab: int = 96, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def build(seed: int):
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def train_step(model, opt, sched, step: int, seed: int, rank: int = 0, sync=None) -> float:
    data = batch_for(step, seed, rank=rank)
    logits = model(data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if sync is not None:
        sync()
    opt.step()
    sched.step()
    return loss.detach().item()


def average_gradients(model: nn.Module, ck=None) -> None:
    """Data-parallel gradient averaging whose sums are the same in every run:
    DDP's all-reduce order depends on its buckets, which it rebuilds in every (re)started process,
    so a restored run would drift from an unbroken one in the last bits; adding every rank's
    gradients in rank order does not. Tells `ck` when this rank's compute ended (stragglers).
    """
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    world = dist.get_world_size()
    parts = [torch.empty_like(flat) for _ in range(world)]
    if ck is not None:
        ck.mark_compute_done()
    dist.all_gather(parts, flat)
    total = sum(parts[1:], parts[0]).div_(world)  # (in rank order)
    for g, part in zip(grads, total.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="tier URL for durable snapshots")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=1, help="persist to --ckpt every N steps")
    p.add_argument("--ram", action="store_true", help="also snapshot every step to the node's RAM tier")
    p.add_argument("--peer", type=int, default=0, help="replicate the RAM tier to this many other nodes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (to watch it)")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank takes --slow-factor times longer")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--run-dir", help="event log directory (default $FTKIT_RUN_DIR)")
    p.add_argument("--final-out", help="write the final model+optimizer state here (torch file, rank 0)")
    p.add_argument("--pg-timeout", type=float, default=1800.0, help="process group timeout, seconds")
    p.add_argument("--no-watchdog", action="store_true", help="run without ftkit's heartbeat watchdog")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="recover from a rank's exception in process (ftkit.run_in_process) instead of through torchrun",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # One thread: bitwise reproducible (this model's CPU kernels are deterministic on one thread, and
    # use_deterministic_algorithms would slow every worker start).
    torch.set_num_threads(1)
    # The one process where FTKIT_UNSAFE_SKIP_CHECKSUMS=1 takes effect (a drill that must fail).
    allow_skipping_checksums()
    register_faulty()  # a drill's durable tier is behind faulty:// (drill/faults.py)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and args.in_process:  # it creates (and re-creates) the process group itself
        final = ftkit.run_in_process(lambda _gen: train(args, world, rank), group_timeout_s=args.pg_timeout)
    else:
        if world > 1:
            from ftkit.coord.dist import init_process_group

            init_process_group("gloo", timeout_s=args.pg_timeout)
        final = train(args, world, rank)
    if final is None:
        return 1
    if args.final_out and rank == 0:
        torch.save(final, args.final_out)
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


def train(args, world: int, rank: int) -> dict | None:
    """Build, restore and train to the last step; the final model and optimizer state (None: a bad loss).
    Built here: all that depends on the process group, so an in-process recovery can call it again."""
    model, opt, sched = build(args.seed)
    state = {"model": model, "optim": opt, "sched": sched}
    tiers: list = []
    if args.ram:
        tiers.append(ftkit.Tier("ram", replicas=args.peer))  # --peer K: K copies on other nodes
    tiers.append(ftkit.Tier(args.ckpt, every=args.every, keep=3))
    with ftkit.Checkpointer(state, tiers, policy="wait", run_dir=args.run_dir, watchdog=not args.no_watchdog) as ck:
        sync = (lambda: average_gradients(model, ck)) if world > 1 else None
        start = ck.restore()
        if rank == 0:
            print(f"resumed from step {start}" if start else "starting fresh", flush=True)
        compute = 0.0
        for step in range(start + 1, args.steps + 1):
            if rank == args.slow_rank:  # e.g. a slow input pipeline: before the forward
                time.sleep((args.slow_factor - 1) * (compute + args.step_time))
            t0 = time.perf_counter()
            loss = train_step(model, opt, sched, step, args.seed, rank, sync)
            # What this rank consumed at this step: drills check the stream against a fault-free run.
            ck.events.emit(
                "batch",
                step=step,
                digest=xxhash.xxh3_64_hexdigest(batch_for(step, args.seed, rank=rank).numpy().tobytes()),
            )
            compute = time.perf_counter() - t0
            if not math.isfinite(loss):
                print(f"loss is {loss} at step {step}", file=sys.stderr)
                return None
            ck.snapshot(step)
            if rank == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
    return {"model": model.state_dict(), "optim": opt.state_dict()}


if __name__ == "__main__":
    sys.exit(main())
