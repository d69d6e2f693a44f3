"""A distributed sampler whose checkpoint is a position in one global sample stream.

``DistributedSampler`` shards by world size, so a job stopped mid-epoch cannot resume on
another number of ranks. Here the job reads one stream (epoch ``e``: ``randperm(N)`` seeded
``seed + e``, then epoch ``e + 1``); from position ``p`` rank ``r`` of ``W`` takes offsets
``p + r + k*W``, and the state is ``p``, the same on any world size. See docs/integrations.md.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class ResumableDistributedSampler(Sampler[int]):
    """Shard one global sample stream over ranks; checkpoint the global position.

    Args:
        dataset_or_len: the dataset (anything with ``len()``) or its length ``N``.
        num_replicas, rank: the world size and this rank; by default from ``torch.distributed``
            if initialized, else ``WORLD_SIZE`` and ``RANK``, else 1 and 0.
        shuffle: each epoch is a fresh permutation (else ``range(N)`` every epoch).
        seed: epoch ``e`` is shuffled with ``seed + e``; the same on every rank.
        drop_last: skip an epoch's last, partial round instead of running on into the next epoch.

    Use: ``advance(n)`` after each step (``n`` samples consumed on each rank, before the
    step's snapshot); ``set_epoch(e)`` as with ``DistributedSampler``, keeping the position
    when ``e`` is the current epoch; ``iter(sampler)``: this rank's indices to the epoch's end.
    ``advance`` rolls the epoch over by itself, so ``while sampler.epoch < E`` works too, but
    only if every yielded sample is advanced over (not with ``DataLoader(drop_last=True)``).
    """

    def __init__(
        self,
        dataset_or_len: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        try:
            n = operator.index(dataset_or_len)  # type: ignore[arg-type]  # an int, not a dataset that is one
        except TypeError:
            n = len(dataset_or_len)  # type: ignore[arg-type]
        num_replicas, rank = _world(num_replicas, rank)
        if n <= 0:
            raise ValueError(f"cannot sample from {n} samples")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in a world of {num_replicas}")
        if drop_last and n < num_replicas:
            raise ValueError(f"drop_last=True with {n} samples and {num_replicas} ranks would yield nothing")
        self.num_samples = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        # The whole state; change it through advance / set_epoch / load_state_dict.
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __len__(self) -> int:
        """The rounds left in this epoch (the last one partial, or dropped with drop_last)."""
        left = self.num_samples - self.position
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        # Computed now, not lazily: the loop advances the position while a
        # prefetching DataLoader is still pulling from this iterator.
        n, w = self.num_samples, self.num_replicas
        offsets = torch.arange(len(self)) * w + (self.position + self.rank)
        ahead = offsets // n  # 0, except in a last round that runs on into the next epoch(s)
        out = torch.empty_like(offsets)
        for k in ahead.unique().tolist():
            sel = ahead == k
            out[sel] = self._order(self.epoch + k)[offsets[sel] % n]
        return iter(out.tolist())

    def advance(self, n: int) -> None:
        """Record that each rank has consumed ``n`` more samples (the job: ``n * W``); the only way
        the position moves, since a DataLoader pulls indices ahead of the loop."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot advance by {n} samples")
        # Epoch by epoch, so that drop_last skips each epoch's tail on the way.
        while n:
            t = min(n, len(self))
            self.position += t * self.num_replicas
            n -= t
            self._roll_over()

    def _roll_over(self) -> None:
        if self.drop_last:
            if self.num_samples - self.position < self.num_replicas:
                self.epoch, self.position = self.epoch + 1, 0
        else:  # a last round that ran on has consumed the start of the next epoch
            self.epoch += self.position // self.num_samples
            self.position %= self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; a no-op for the current one, so a resumed loop keeps its position."""
        epoch = operator.index(epoch)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe, and the same on every rank."""
        return {k: getattr(self, k) for k in ("epoch", "position", "seed", "shuffle", "num_samples")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved stream (its ``seed`` and ``shuffle`` too) at the saved position, on this
        world size; a different dataset length is refused (ValueError)."""
        n = int(state["num_samples"])
        if n != self.num_samples:
            raise ValueError(f"the checkpoint's sampler covered {n} samples, this one {self.num_samples}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ValueError(f"bad sampler state: epoch {epoch}, position {position}")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = epoch, position
        # With fewer or more ranks, drop_last may now have nothing left in this epoch.
        self._roll_over()


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if dist.is_available() and dist.is_initialized():
            world, me = dist.get_world_size(), dist.get_rank()
        else:
            world, me = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        num_replicas = world if num_replicas is None else num_replicas
        rank = me if rank is None else rank
    return int(num_replicas), int(rank)
