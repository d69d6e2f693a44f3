"""NVIDIA's resiliency extension (nvidia-resiliency-ext 0.4.1) as bench_anchors.py runs it on CPU.

What runs here, and what does not (each checked on this machine):

* Asynchronous checkpointing: its high-level `TorchAsyncCheckpoint.async_save` and the
  non-persistent `AsyncCallsQueue` call `torch.cuda.synchronize()` unconditionally
  ("Torch not compiled with CUDA enabled"). The path Megatron-LM uses runs, with two
  CPU settings and no change to NVRx's code: `FileSystemWriterAsync` planned by
  `save_state_dict_async_plan` (with its metadata cache, as Megatron's
  `--ckpt-assume-constant-structure`), scheduled on a persistent `AsyncCallsQueue`,
  its preload with `non_blocking=False` (the default one synchronizes CUDA), finalized
  with `no_dist=True` (the distributed one all-reduces on a CUDA device). It needs
  torch.distributed: a one-rank gloo group here. It fsyncs its data files and its
  metadata (not the directory). It does not copy the tensors: they are moved into
  shared memory and the worker writes them as they are when it gets to them, so a
  training step that changes them right after the call changes what is saved
  ("NVRx + clone" copies them first, as a caller must for a consistent save).
* Its local checkpoint manager asserts `is_cuda` on every tensor and saves
  asynchronously only through CUDA; its in-process restart releases ranks blocked in a
  collective by aborting NCCL only (a gloo rank waits for its process group's timeout),
  and under torchrun a SIGKILLed rank ends the whole group: see `INPROCESS_WHY`.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import disk_bytes_of, now
from nvidia_resiliency_ext.checkpointing.async_ckpt.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
    CheckpointMetadataCache,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

INPROCESS_WHY = (
    "not this fault: under torchrun a SIGKILLed rank makes the agent end the whole group before NVRx's "
    "in-process restart can act (tried: 2 ranks, gloo); an exception is recovered in process, but only after "
    "gloo's timeout (NVRx aborts NCCL groups only): see docs/performance.md"
)
_queue: AsyncCallsQueue | None = None


def _one_rank_group() -> None:
    """NVRx plans through torch.distributed; a one-rank gloo group where none exists."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _shared_queue() -> AsyncCallsQueue:
    """One persistent worker for the process (NVRx starts it with spawn, once)."""
    global _queue
    if _queue is None:
        _queue = AsyncCallsQueue(persistent=True)
    return _queue


class NvrxSaver:
    """bench_anchors.Saver's interface over NVRx's asynchronous save; a directory per save,
    the previous one deleted after the next is durable, outside the figures."""

    fsyncs = True

    def __init__(self, state: dict[str, torch.Tensor], root: str, name: str, clone: bool):
        _one_rank_group()
        self.state, self.root, self.name, self.clone = state, root, name, clone
        os.makedirs(root, exist_ok=True)
        self.cache = CheckpointMetadataCache()
        self.queue = _shared_queue()

    def begin(self, step: int) -> float:
        self.path = os.path.join(self.root, f"step-{step}")
        t0 = now()
        sd = {k: v.clone() for k, v in self.state.items()} if self.clone else self.state
        writer = FileSystemWriterAsync(self.path, thread_count=2)
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            sd, writer, None, 0, planner=DefaultSavePlanner(), enable_cache=True, metadata_cache=self.cache
        )
        save_fn, _cuda_preload, save_args = writer.get_save_function_and_args()
        request = AsyncRequest(
            save_fn,
            save_args,
            [lambda: save_state_dict_async_finalize(writer, metadata, dist_wrapper)],
            preload_fn=partial(FileSystemWriterAsync.preload_tensors, writer.write_buckets, False),
        )
        self.queue.schedule_async_request(request)
        self.returned = now()
        return self.returned - t0

    def end(self) -> tuple[float, float]:
        # what a training loop polls each step; blocking=True would poll every 0.1 s itself
        deadline = time.monotonic() + 600
        while not self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True):
            if time.monotonic() > deadline:
                raise RuntimeError("NVRx: the save did not finish within 600 s")
            time.sleep(0.001)
        durable = now() - self.returned
        for old in os.listdir(self.root):
            if os.path.join(self.root, old) != self.path:
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        return durable, 0.0

    def restore(self, dest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return nvrx_restore(self.root, dest)

    def stored(self) -> int:
        return disk_bytes_of(self.root)

    def close(self) -> None:
        global _queue
        if _queue is not None:
            _queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            if _queue.persistent_caller is not None:
                _queue.persistent_caller.close()  # joins the spawned worker
            _queue = None


def nvrx_restore(root: str, dest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVRx's reading path: DCP's load through its cached-metadata reader, into `dest`."""
    _one_rank_group()
    (newest,) = os.listdir(root)
    dcp.load(dest, storage_reader=CachedMetadataFileSystemReader(os.path.join(root, newest)))
    return dest
