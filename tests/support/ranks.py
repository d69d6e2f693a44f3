"""Run a function on W real processes joined in a gloo process group.

The processes come from a fork server that has torch and the test modules
imported already, so a 4-rank group starts in well under a second instead of
~10 s of interpreter start-up on this 2-core machine, and each starts clean
(nothing inherited from pytest's threads or signal handlers). They talk over a
real TCPStore on a free loopback port and a real gloo group. Tests about
torchrun itself (restarts, agents) use torchrun.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Imported once by the fork server so every rank starts with them: DDP's first
# construction imports torch._dynamo (~1.5 s alone, ~6 s with four ranks on two cores).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "ftkit", "ranks"]
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)


def _child(fn: Callable, rank: int, world: int, port: int, env: dict[str, str], args: tuple, queue) -> None:
    code = 0
    try:
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **env,
            }
        )
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        os._exit(code)  # skip the parent's atexit handlers and pytest's teardown in the child


def run_ranks(
    world: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, timeout: float = 120
) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; their return values by rank.

    Raises AssertionError with the failing rank's traceback if any rank fails.
    """
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = _ctx
    queue = ctx.SimpleQueue()  # put() is synchronous: nothing is lost at the child's os._exit
    procs = [ctx.Process(target=_child, args=(fn, r, world, server.port, env or {}, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world):
            while queue.empty():
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks did not finish within {timeout:.0f}s")
                if all(not p.is_alive() for p in procs) and queue.empty():
                    raise AssertionError("every rank exited without reporting")
                time.sleep(0.02)
            rank, status, value = queue.get()
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]
