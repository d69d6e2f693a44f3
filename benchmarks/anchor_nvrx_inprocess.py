"""NVRx 0.4.1 in-process restart (inprocess.Wrapper) on CPU with gloo, 2 ranks.

Run (torchrun):
  .venv/bin/torchrun --nproc-per-node 2 --master-port 29700 \
      benchmarks/anchor_nvrx_inprocess.py --fault exception --pg-timeout 3 [--fast]
  .venv/bin/torchrun --nproc-per-node 2 --master-port 29700 \
      benchmarks/anchor_nvrx_inprocess.py --fault sigkill   # whole job torn down by torchrun
Run (plain launcher, no torchrun agent watching the ranks):
  .venv/bin/python benchmarks/anchor_nvrx_inprocess.py --launch 2 --fault sigkill --pg-timeout 3 [--fast]

Each rank runs a tiny data-parallel loop (Linear model, gloo all_reduce of grads). At step
--fault-step of restart iteration 0, rank --fault-rank raises RuntimeError or SIGKILLs itself,
after writing the fault wall-clock time to <out>/fault_time. Surviving ranks log the wall-clock
time of every step; 'fault -> first step after restart' = first step time in iteration >= 1
minus fault time.

KEY CPU LIMITATION: stock AbortTorchDistributed only aborts NCCL backends, so a rank blocked in a
gloo collective is released only by the gloo PG timeout (--pg-timeout) or by a peer connection reset
(SIGKILL); restart latency after an exception ~= pg timeout + ~0.5 s.  Under torchrun a SIGKILLed
rank makes the torchrun agent SIGTERM all workers (no in-process restart); use --launch.

CPU adaptations: no CudaHealthCheck / ThreadedFinalize(CUDA); abort = default
AbortTorchDistributed (its NCCL-only backend abort is skipped for gloo, then
destroy_process_group()).  Process group re-created per restart iteration on
PrefixStore(iteration, base_store) as in NVRx's examples.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist

torch.set_num_threads(1)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fault", choices=["exception", "sigkill", "none"], default="exception")
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--out", default="/tmp/ftkit-anchor-nvrx-inprocess")
    ap.add_argument(
        "--fast",
        action="store_true",
        help="tuned intervals (0.1 s monitors, 3 s heartbeat timeout) instead of NVRx defaults",
    )
    ap.add_argument("--pg-timeout", type=float, default=30.0)
    ap.add_argument(
        "--gloo-abort",
        action="store_true",
        help="an Abort that calls ProcessGroupGloo.abort() (does not help: the peer stays blocked in gloo's "
        "recv until the hard timeout kills it)",
    )
    ap.add_argument("--launch", type=int, default=0, help="spawn N ranks without torchrun")
    return ap.parse_args()


class AbortGloo(inprocess.abort.Abort):
    """CPU variant of AbortTorchDistributed: abort gloo backends, then destroy process groups."""

    def __call__(self, state):
        if dist.is_available() and dist.is_initialized():
            for pg in list(dist.distributed_c10d._world.pg_names):
                try:
                    pg._get_backend(torch.device("cpu")).abort()
                except Exception:
                    pass
            dist.destroy_process_group()
        return state


def train(base_store, args, call_wrapper: inprocess.CallWrapper | None = None):
    it = call_wrapper.iteration
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(f"pg_{it}", base_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    log = open(os.path.join(args.out, f"steps_initrank{os.environ['INIT_RANK']}.jsonl"), "a")
    for step in range(args.steps):
        if it == 0 and step == args.fault_step and rank == args.fault_rank and args.fault != "none":
            with open(os.path.join(args.out, "fault_time"), "w") as f:
                f.write(repr(time.time()))
            if args.fault == "exception":
                raise RuntimeError(f"injected fault on rank {rank}")
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, 256)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ws
        opt.step()
        call_wrapper.ping()
        log.write(json.dumps({"t": time.time(), "iteration": it, "step": step, "rank": rank, "ws": ws}) + "\n")
        log.flush()
        time.sleep(args.step_sleep)
    log.close()
    dist.barrier()
    dist.destroy_process_group()
    return it


def worker(args):
    os.environ["INIT_RANK"] = os.environ["RANK"]
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        port + 1,
        int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    kw = {}
    if args.fast:
        kw = dict(
            monitor_thread_interval=timedelta(seconds=0.1),
            monitor_process_interval=timedelta(seconds=0.1),
            progress_watchdog_interval=timedelta(seconds=0.1),
            heartbeat_interval=timedelta(seconds=0.5),
            heartbeat_timeout=timedelta(seconds=3),
            last_call_wait=timedelta(seconds=0.1),
            soft_timeout=timedelta(seconds=20),
            hard_timeout=timedelta(seconds=25),
            barrier_timeout=timedelta(seconds=40),
            completion_timeout=timedelta(seconds=40),
        )
    if args.gloo_abort:
        kw["abort"] = AbortGloo()
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": port + 2},
        monitor_process_logfile=os.path.join(args.out, "monitor_{rank}.log"),
        **kw,
    )(train)
    t0 = time.time()
    ret = wrapped(base_store, args)
    print(
        json.dumps({"init_rank": os.environ["INIT_RANK"], "returned_iteration": ret, "wall_s": time.time() - t0}),
        flush=True,
    )


def summarize(out):
    res = {}
    fp = os.path.join(out, "fault_time")
    tf = float(open(fp).read()) if os.path.exists(fp) else None
    for fn in sorted(os.listdir(out)):
        if not fn.startswith("steps_"):
            continue
        rows = [json.loads(line) for line in open(os.path.join(out, fn))]
        after = [r for r in rows if r["iteration"] >= 1]
        before = [r for r in rows if r["iteration"] == 0]
        d = {
            "steps_iter0": len(before),
            "steps_after": len(after),
            "iterations": sorted({r["iteration"] for r in rows}),
            "ws_after": after[0]["ws"] if after else None,
        }
        if tf is not None and after:
            d["fault_to_first_step_after_restart_ms"] = (after[0]["t"] - tf) * 1e3
        if tf is not None and before:
            d["last_step_before_fault_ms_before"] = (tf - before[-1]["t"]) * 1e3
        res[fn] = d
    return res


def main():
    args = parse()
    if args.launch:
        import shutil

        shutil.rmtree(args.out, ignore_errors=True)
        os.makedirs(args.out)
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = []
        for r in range(args.launch):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(args.launch),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(args.launch),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            a = [x for x in sys.argv[1:]]
            i = a.index("--launch")
            del a[i : i + 2]
            procs.append(subprocess.Popen([sys.executable, __file__] + a, env=env))
        rcs = []
        try:
            for p in procs:
                rcs.append(p.wait(timeout=240))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        print(json.dumps({"rcs": rcs, "summary": summarize(args.out)}, indent=1))
        return
    if int(os.environ["RANK"]) == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        import shutil

        shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    time.sleep(0.5)
    worker(args)
    if int(os.environ["INIT_RANK"]) == 0:
        time.sleep(0.5)
        print(json.dumps({"summary": summarize(args.out)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
