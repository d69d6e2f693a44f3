"""The data position reshards: 2 ranks stopped, 3 ranks resume, the global stream is exact."""

from __future__ import annotations

import dist_worker
import torch
from ranks import run_ranks


def _global_stream(per_rank: list[list[tuple[int, list[int]]]]) -> list[int]:
    """Interleave the ranks' batches the way the sampler deals them: round k, rank r."""
    stream = []
    for step_batches in zip(*per_rank):
        batches = [b for _, b in step_batches]
        for k in range(len(batches[0])):
            stream += [b[k] for b in batches]
    return stream


def test_two_ranks_restarted_as_three_consume_the_exact_stream(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(2, dist_worker.sampler_run, ckpt, 9)  # 9 steps x 2 ranks x 4 = 72 samples
    second = run_ranks(3, dist_worker.sampler_run, ckpt, 16)  # resumes at step 9
    assert [s for s, _ in second[0]] == list(range(10, 17))
    consumed = _global_stream(first) + _global_stream(second)
    epochs = [torch.randperm(50, generator=torch.Generator().manual_seed(7 + e)).tolist() for e in range(4)]
    expected = [i for e in epochs for i in e][: len(consumed)]
    assert consumed == expected  # nothing skipped, nothing repeated, across two epoch boundaries
    assert len(consumed) > 100
