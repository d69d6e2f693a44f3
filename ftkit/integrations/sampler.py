"""A distributed sampler whose checkpoint is a position in one global sample stream.

``torch.utils.data.DistributedSampler`` remembers only the epoch, so a job that
stops mid-epoch either replays the epoch or, if it counts batches per rank,
cannot resume on a different number of ranks: rank ``r`` of 2 and rank ``r`` of 3
see different shards. Here the job as a whole reads *one* stream, and the state
is a position in it, which means the same thing whatever the world size.

The stream: epoch ``e`` is ``torch.randperm(N)`` drawn from a generator seeded
with ``seed + e`` (``range(N)`` when ``shuffle=False``); the stream is epoch 0,
then epoch 1, and so on. ``position`` ``p`` counts the samples of the current
epoch that the job (all ranks together) has consumed. From there, the ``W``
ranks read it round by round, interleaved: rank ``r`` takes stream offsets
``p + r + k*W`` for ``k = 0, 1, ...``; round ``k`` is offsets ``p + k*W`` to
``p + k*W + W - 1``.

The end of an epoch, when ``N - p`` is not a multiple of ``W``. Every rank must
yield the same number of samples (DDP steps in lockstep), so the last round is
either completed or dropped:

* ``drop_last=False`` (default): ``ceil((N - p) / W)`` rounds. The last one runs
  on into the *next* epoch's order, so it ends with the first ``c < W`` samples
  of epoch ``e + 1``, and epoch ``e + 1`` then starts at position ``c``. Nothing
  is skipped and nothing is repeated: every epoch's permutation is consumed
  exactly once, in order, whatever the world size was along the way. (A pass
  over the loader may therefore contain a few indices twice, once from each
  epoch; ``DistributedSampler`` instead pads with the start of the *same*
  epoch, which repeats those samples and then serves them again.)
* ``drop_last=True``: ``floor((N - p) / W)`` rounds; the last ``(N - p) % W``
  samples of the epoch are skipped and the next epoch starts at position 0.
  Which samples that is depends on the world size when the epoch ends.

Counting what this sampler yields would over-count: a ``DataLoader`` pulls
indices ahead of the training loop (prefetching, worker queues). So the position
moves only through :meth:`advance`, which the loop calls with the number of
samples each rank consumed, once per step and before that step's snapshot.
Every rank calls it with the same ``n``, so :meth:`state_dict` is the same on
every rank and rank 0's copy is enough.
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
        num_replicas, rank: the world size and this rank; when not given, from
            ``torch.distributed`` if it is initialized, else from the ``WORLD_SIZE``
            and ``RANK`` environment variables, else 1 and 0.
        shuffle: each epoch is a fresh permutation (else ``range(N)`` every epoch).
        seed: epoch ``e`` is shuffled with ``seed + e``; the same on every rank.
        drop_last: what happens to an epoch's last, partial round (module docstring).

    Use:

    * ``advance(n)`` after each step: ``n`` samples consumed on each rank.
    * ``set_epoch(e)``: as with ``DistributedSampler``; jumps to the start of
      epoch ``e``, unless ``e`` is already the current epoch (after a restore, or
      after :meth:`advance` rolled over into it), in which case the position is kept.
    * ``iter(sampler)``: this rank's indices from the current position to the end
      of the current epoch; fixed when the iterator is created.
    * ``len(sampler)``: how many indices that is.

    The epoch rolls over on its own: when :meth:`advance` reaches the end of the
    epoch (for ``drop_last=True``: fewer than ``W`` samples left), ``epoch`` goes
    up by one and ``position`` starts at the carried-over count (or 0). So either
    ``for epoch in range(sampler.epoch, E): sampler.set_epoch(epoch); ...`` or
    ``while sampler.epoch < E: ...`` resumes correctly. The ``while`` form needs
    every yielded sample to be advanced over: a ``DataLoader(drop_last=True)``
    never delivers an epoch's last partial batch, so the epoch would never end
    (use this sampler's ``drop_last``, or the ``for`` form, whose ``set_epoch``
    moves on).
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

    # -- the stream -----------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def _rounds_left(self) -> int:
        left = self.num_samples - self.position
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def __len__(self) -> int:
        return self._rounds_left()

    def __iter__(self) -> Iterator[int]:
        # Computed now, not lazily: the loop advances the position while a
        # prefetching DataLoader is still pulling from this iterator.
        n, w = self.num_samples, self.num_replicas
        offsets = torch.arange(self._rounds_left()) * w + (self.position + self.rank)
        ahead = offsets // n  # 0, except in a last round that runs on into the next epoch(s)
        out = torch.empty_like(offsets)
        for k in ahead.unique().tolist():
            sel = ahead == k
            out[sel] = self._order(self.epoch + k)[offsets[sel] % n]
        return iter(out.tolist())

    # -- moving through it -----------------------------------------------------

    def advance(self, n: int) -> None:
        """Record that each rank has consumed ``n`` more samples (the job: ``n * W``)."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot advance by {n} samples")
        # Epoch by epoch, so that drop_last skips each epoch's tail on the way.
        while n:
            t = min(n, self._rounds_left())
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
        """Go to the start of ``epoch``; a no-op if it is the current one, so that a
        resumed loop re-setting its epoch does not rewind the restored position."""
        epoch = operator.index(epoch)
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    # -- checkpointing -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe, and the same on every rank."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved stream at the saved global position, on this world size.

        ``seed`` and ``shuffle`` are taken from the checkpoint: they define the
        stream being continued. A different dataset length is refused.
        """
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
