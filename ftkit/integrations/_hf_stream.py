"""The Hugging Face Trainer's sample stream, continued exactly on another number of ranks.

With accelerate's seedable sampler the job reads one stream (epoch ``t``'s permutation, seeded
``seed + t``, then ``t + 1``'s); a position in it is a count of samples (`StreamPosition`). The
Trainer derives where to resume from ``global_step`` and the *new* world's steps per epoch,
elsewhere in the stream on another world size. So `continue_stream` leaves that arithmetic
alone and swaps the loader's sampler for `ContinuedSampler`, which serves each epoch the Trainer
runs as the window of the stream that continues the run: every sample once, in order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import SequentialSampler


@dataclass(frozen=True)
class StreamPosition:
    """`samples` consumed from the start of epoch 0; `per_epoch`: the samples one epoch consumes
    (the dataset's length, or its whole batches with ``drop_last``)."""

    samples: int
    per_epoch: int

    @staticmethod
    def from_json(doc: Any) -> StreamPosition | None:
        if not isinstance(doc, dict):
            return None
        s, p = doc.get("samples"), doc.get("per_epoch")
        if type(s) is not int or type(p) is not int or s < 0 or p <= 0:
            return None
        return StreamPosition(s, p)


@dataclass(frozen=True)
class Layout:
    """How the running Trainer reads the stream (`batch`: per rank; `accum`: batches per step);
    its epoch `first_epoch` starts at sample `start` (0, 0 unless it continues another world's)."""

    world: int
    batch: int
    accum: int
    steps_per_epoch: int
    per_epoch: int
    start: int = 0
    first_epoch: int = 0

    def position(self, global_step: int) -> StreamPosition:
        """The stream position after `global_step` steps of this run."""
        epoch, step = divmod(global_step, self.steps_per_epoch)
        done = min(step * self.accum * self.world * self.batch, self.per_epoch)
        return StreamPosition(self.start + (epoch - self.first_epoch) * self.per_epoch + done, self.per_epoch)


def trainer_layout(args: Any, loader: Any) -> tuple[Layout, Any, Any] | None:
    """(layout, batch sampler, its sampler) of the Trainer's training loader; None when its order
    cannot be reproduced (another sampler, an iterable dataset, split or dispatched batches)."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, SeedableRandomSampler

    if type(loader) is DataLoaderDispatcher:  # (isinstance would not do: its __class__ says DataLoader)
        return None  # rank 0 reads every rank's batches and sends them: another layout
    outer = getattr(loader, "batch_sampler", None)
    world = 1
    if isinstance(outer, BatchSamplerShard):
        if outer.split_batches:
            return None
        world, outer = outer.num_processes, outer.batch_sampler
    sampler = getattr(outer, "sampler", None)
    if outer is None or not isinstance(sampler, (SeedableRandomSampler, SequentialSampler, ContinuedSampler)):
        return None
    if isinstance(sampler, SeedableRandomSampler) and sampler.replacement:
        return None
    n = len(sampler.inner) if isinstance(sampler, ContinuedSampler) else len(sampler)
    batch, accum = outer.batch_size, args.gradient_accumulation_steps
    per_epoch = (n // batch) * batch if outer.drop_last else n
    steps = max(math.ceil(len(loader) / accum), 1)  # as Trainer.set_initial_training_values counts
    return Layout(world, batch, accum, steps, per_epoch), outer, sampler


class ContinuedSampler:
    """Stands in for the Trainer's sampler: its epoch ``e`` (`set_epoch`; `first_epoch` until
    called) yields ``len(inner)`` samples of the stream from ``start + (e - first_epoch) *
    per_epoch``, nothing past `end`."""

    def __init__(self, inner: Any, layout: Layout, end: int | None):
        self.inner = inner  # the Trainer's own sampler: its permutation of epoch t is the stream's
        self.layout = layout
        self.end = end
        self.epoch = layout.first_epoch
        self._cached: tuple[int, list[int]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        lay = self.layout
        first = lay.start + (self.epoch - lay.first_epoch) * lay.per_epoch
        for at in range(first, first + len(self.inner)):
            if self.end is not None and at >= self.end:
                return
            yield self._sample(max(at, 0))  # (before the stream's start: skipped batches)

    def _sample(self, at: int) -> int:
        epoch, offset = divmod(at, self.layout.per_epoch)
        if self._cached is None or self._cached[0] != epoch:
            if hasattr(self.inner, "set_epoch"):
                self.inner.set_epoch(epoch)  # accelerate's seedable sampler: seed + epoch
            self._cached = (epoch, list(iter(self.inner)))
        return self._cached[1][offset]


def continue_stream(
    saved: StreamPosition, layout: Layout, outer: Any, sampler: Any, global_step: int, epochs: float | None
) -> tuple[Layout, int | None]:
    """Make the Trainer's loader continue the stream at `saved` from the resumed `global_step`;
    (the layout in force, the step where the planned `epochs` end or None). Nothing is swapped
    when the Trainer's own resume lands on `saved`."""
    inner = sampler.inner if isinstance(sampler, ContinuedSampler) else sampler
    fresh = dataclasses.replace(layout, start=0, first_epoch=0)
    at = fresh.position(global_step)  # where the Trainer's own arithmetic resumes
    if at == saved:  # the Trainer's own skip is exact, and so is its end
        outer.sampler = inner
        return fresh, None
    epoch = global_step // layout.steps_per_epoch
    skipped = at.samples - epoch * layout.per_epoch  # what the Trainer skips of its epoch
    now = dataclasses.replace(fresh, start=saved.samples - skipped, first_epoch=epoch)  # skips what precedes `saved`
    end = planned_end(epochs, saved)
    outer.sampler = ContinuedSampler(inner, now, end)
    if end is None:
        return now, None
    per_step = layout.world * layout.accum * layout.batch
    return now, global_step + max(math.ceil((end - saved.samples) / per_step), 0)


def planned_end(epochs: float | None, saved: StreamPosition) -> int | None:
    """Where the planned `epochs` end in the stream, in samples (None: the run is defined by steps)."""
    return math.ceil(epochs * saved.per_epoch) if epochs is not None else None


def stream_ended(stop_at: int | None, global_step: int) -> bool:
    """Whether the run has reached the step at which its planned epochs of the stream end."""
    return stop_at is not None and global_step >= stop_at


def why_not_continued(args: Any, found: Any, saved: StreamPosition | None) -> str | None:
    """Why a resume cannot continue the snapshot's place in the stream, or None when it can."""
    if args.ignore_data_skip:
        return "ignore_data_skip is set: the Trainer starts the epoch over"
    if found is None:
        return "the data loader's order is not reproducible"
    if saved is None:
        return "the snapshot has none"
    if saved.per_epoch != found[0].per_epoch:
        return "the dataset's length changed"
    return None
