"""One rank of two whose training loop runs on a thread (rank 0; its main thread only waits), the
other on its main thread; rank 1 gets SIGTERM at step 10. Both must save the agreed step and exit
128 + SIGTERM. Usage: python thread_preempt.py RANK PORT DIR"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import ftkit

rank, port, d = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2", FTKIT_RAM_DIR=f"{d}/shm")
dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)


def train() -> None:
    with ftkit.Checkpointer({"m": torch.nn.Linear(4, 4)}, [f"{d}/ckpt"], run_dir=f"{d}/run") as ck:
        for step in range(1, 400):
            time.sleep(0.05)
            ck.snapshot(step)
            if step == 10 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
    print(f"rank {rank}: the loop ended without the preemption's exit", flush=True)


if rank == 0:
    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
else:
    train()
