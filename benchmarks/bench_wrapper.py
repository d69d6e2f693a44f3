"""In-process recovery's fault-free cost: step time inside ``ftkit.run_in_process`` vs outside, paired.

    .venv/bin/python benchmarks/bench_wrapper.py [--nproc 2] [--pairs 2000] [--steps 1] [--json FILE]

One torchrun job (gloo, CPU), one Checkpointer. Every rank alternates blocks of
--steps steps of the reference trainer (tiny GPT, gradients averaged in rank
order, a RAM-tier snapshot every step, the watchdog on) outside the wrapper and
inside it, in the same processes, group and Checkpointer, so what drifts on a
shared machine (±10% here from one job to the next, and more from one second to
the next) cancels within a pair of steps 40 ms apart. Half the pairs run outside
first, half inside first. (Blocks of 10 or 40 steps gave per-pair ratios spread over
±20-40% and intervals of ±2-4%; single steps spread wider but pair closer in time,
and 1,000 pairs gave ±1.2%.) It prints the median step time each way, the
median of the pairs' ratios and a bootstrap 95% interval for it: the noise bound
the issue asks the figure to carry (target: within 1%). The wrapper's own set-up
(group checks, gc.freeze, a signal handler) happens once per call and is not in
the steps; what it adds to a step is what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import ftkit
    from ftkit.drill.reference import average_gradients, build, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, sched = build(1234)
    state = {"model": model, "optim": opt, "sched": sched}
    step = 0
    with ftkit.Checkpointer(state, [ftkit.Tier("ram")]) as ck:

        def block(_gen: ftkit.Generation | None = None) -> float:
            """--steps steps; their mean step time (the snapshot call included)."""
            nonlocal step
            dist.barrier()  # the ranks start each block together
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step += 1
                train_step(model, opt, sched, step, 1234, rank, sync=lambda: average_gradients(model, ck))
                ck.snapshot(step)
            return (time.perf_counter() - t0) / args.steps

        for _ in range(3):
            block()  # warm-up: allocations, the first snapshots' set-up
        rows = []
        for i in range(args.pairs):
            if i % 2 == 0:
                outside = block()
                inside = ftkit.run_in_process(block)
            else:
                inside = ftkit.run_in_process(block)
                outside = block()
            rows.append({"outside_s": outside, "inside_s": inside})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def bootstrap(ratios: list[float], rounds: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--steps", type=int, default=1, help="steps per block")
    p.add_argument("--json", help="append the result here as one JSON line")
    p.add_argument("--out", help=argparse.SUPPRESS)  # (a worker's: where rank 0 writes its blocks)
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="ftkit-bench-wrapper-") as root:
        out = os.path.join(root, "blocks.json")
        env = {
            **os.environ,
            "FTKIT_RAM_DIR": os.path.join(root, "shm"),
            "FTKIT_JOB_ID": "bench",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        cmd += [os.path.abspath(__file__), "--pairs", str(args.pairs), "--steps", str(args.steps), "--out", out]
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
            return 1
        with open(out) as f:
            rows = json.load(f)
    ratios = [row["inside_s"] / row["outside_s"] for row in rows]
    lo, hi = bootstrap(ratios)
    median = statistics.median(ratios)
    outside = statistics.median(row["outside_s"] for row in rows)
    inside = statistics.median(row["inside_s"] for row in rows)
    spread = (min(ratios) - 1, max(ratios) - 1)
    print(f"reference trainer, {args.nproc} ranks (gloo, CPU), RAM snapshot every step, watchdog on")
    print(
        f"{args.pairs} pairs of {args.steps}-step blocks: median step {outside * 1e3:.2f} ms outside the wrapper, "
        f"{inside * 1e3:.2f} ms inside; per-pair ratio from {spread[0]:+.1%} to {spread[1]:+.1%}"
    )
    verdict = "PASS" if hi - 1 <= 0.01 else "MISS"  # at most 1% slower, with 95% confidence
    print(
        f"in-process wrapper: {median - 1:+.2%} median step time (95% interval {lo - 1:+.2%} .. {hi - 1:+.2%})"
        f"  {verdict}: target within 1%"
    )
    if args.json:
        doc = {
            "bench": "wrapper",
            "nproc": args.nproc,
            "pairs": args.pairs,
            "steps_per_block": args.steps,
            "outside_step_ms": outside * 1e3,
            "inside_step_ms": inside * 1e3,
            "overhead": median - 1,
            "overhead_ci95": [lo - 1, hi - 1],
        }
        with open(args.json, "a") as f:
            f.write(json.dumps(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
