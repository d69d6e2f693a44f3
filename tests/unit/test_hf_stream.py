"""The HF Trainer's sample stream continued on another number of ranks (ftkit/integrations/
_hf_stream.py), without processes: accelerate's own seedable sampler and torch's batch
sampler, read the way the Trainer reads them after a resume (skip what its arithmetic says
was trained, then train on). The 2 -> 3 rank run under torchrun is in
test_integrations_multiprocess.py."""

from __future__ import annotations

import pytest
from accelerate.data_loader import SeedableRandomSampler  # the test extra installs it: missing is a failure
from torch.utils.data import BatchSampler

from ftkit.integrations._hf_stream import (
    ContinuedSampler,
    Layout,
    StreamPosition,
    continue_stream,
    stream_ended,
)

N, B = 48, 4  # samples, per-rank batch


def stream(total: int) -> list[int]:
    s, out, epoch = SeedableRandomSampler(range(N), data_seed=0), [], 0
    while len(out) < total:
        s.set_epoch(epoch)
        out += list(iter(s))
        epoch += 1
    return out[:total]


def layout(world: int, accum: int = 1) -> Layout:
    per_rank = -(-N // B // world)  # the Trainer's loader length on each rank (accelerate pads to whole rounds)
    return Layout(world, B, accum, -(-per_rank // accum), N)


def trained_after_resume(outer: BatchSampler, lay: Layout, step: int, steps: int) -> list[int]:
    """What a Trainer of `lay` trains in `steps` steps resumed at `step`: it sets its epoch,
    skips the per-rank batches its arithmetic says were done, and reads round by round."""
    epoch, done = divmod(step, lay.steps_per_epoch)
    per_step = lay.world * lay.accum  # global batches a step trains
    out: list[int] = []
    while steps > 0:
        if isinstance(outer.sampler, ContinuedSampler):
            outer.sampler.set_epoch(epoch)
        batches = list(outer)[done * per_step :]
        take = min(steps, len(batches) // per_step)
        out += [i for b in batches[: take * per_step] for i in b]
        steps -= take
        epoch, done = epoch + 1, 0
    return out


def test_a_fresh_run_counts_its_place_in_the_stream_by_its_own_steps():
    two = layout(2)
    assert two.steps_per_epoch == 6
    assert two.position(0) == StreamPosition(0, N)
    assert two.position(9) == StreamPosition(48 + 3 * 8, N)  # epoch 1, 3 steps of 2 x 4
    assert two.position(12) == StreamPosition(96, N)


@pytest.mark.parametrize(
    ("saved_world", "step", "world", "accum"), [(2, 9, 3, 1), (3, 5, 2, 1), (2, 7, 1, 1), (3, 4, 2, 1), (2, 4, 3, 2)]
)
def test_the_trainer_trains_on_from_the_saved_sample_on_another_world(saved_world, step, world, accum):
    saved = layout(saved_world, accum).position(step)
    lay = layout(world, accum)
    outer = BatchSampler(SeedableRandomSampler(range(N), data_seed=0), B, False)
    now, stop_at = continue_stream(saved, lay, outer, outer.sampler, step, epochs=3)
    assert now.position(step) == saved
    per_step = world * B * accum
    assert stop_at == step + -(-(3 * N - saved.samples) // per_step)
    steps = min(stop_at - step, 3)
    got = trained_after_resume(outer, lay, step, steps)
    assert got == stream(saved.samples + steps * per_step)[saved.samples :]
    # The snapshot after them is where the stream went on.
    assert now.position(step + steps) == StreamPosition(saved.samples + steps * per_step, N)


def test_the_same_world_keeps_the_trainers_own_resume():
    saved = layout(2).position(9)
    outer = BatchSampler(SeedableRandomSampler(range(N), data_seed=0), B, False)
    inner = outer.sampler
    now, stop_at = continue_stream(saved, layout(2), outer, inner, 9, epochs=3)
    assert outer.sampler is inner and stop_at is None and now == layout(2)


def test_a_shrunk_world_stops_where_the_planned_epochs_end():
    saved = layout(3).position(5)  # 60 samples in
    outer = BatchSampler(SeedableRandomSampler(range(N), data_seed=0), B, False)
    _, stop_at = continue_stream(saved, layout(2), outer, outer.sampler, 5, epochs=3)
    assert stop_at == 5 + 11  # 84 samples left, 8 a step: the last step has one batch
    assert not stream_ended(stop_at, 15) and stream_ended(stop_at, 16)
    last_epoch = outer.sampler
    assert isinstance(last_epoch, ContinuedSampler)
    last_epoch.set_epoch(2)  # the window past the end serves only what is left of the stream
    assert list(last_epoch) == stream(3 * N)[116:]


def test_a_position_read_back_is_checked():
    assert StreamPosition.from_json({"samples": 72, "per_epoch": 48}) == StreamPosition(72, 48)
    for bad in (None, {}, {"samples": -1, "per_epoch": 48}, {"samples": 1, "per_epoch": 0}, {"samples": "1"}):
        assert StreamPosition.from_json(bad) is None
