"""ResumableDistributedSampler: one global stream, resumable on any world size.

Ranks are simulated in-process: W sampler instances with rank=0..W-1 and no
process group. The reference for every test is the stream itself, built here
independently of the sampler: epoch e is randperm(N) seeded with seed + e.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Sampler

import ftkit
from ftkit.integrations.sampler import ResumableDistributedSampler


def epoch_order(n: int, epoch: int, seed: int = 0, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def stream(n: int, epochs: int, seed: int = 0, shuffle: bool = True) -> list[int]:
    return [i for e in range(epochs) for i in epoch_order(n, e, seed, shuffle)]


def rank_share(n: int, world: int, rank: int, epoch: int, position: int, seed: int = 0) -> list[int]:
    """What rank `rank` of `world` should yield from (epoch, position) with drop_last=False."""
    rounds = -(-(n - position) // world)
    rest = [i for e in range(epoch, epoch + 2 + world // n) for i in epoch_order(n, e, seed)]
    return rest[position + rank :: world][:rounds]


def ranks(n: int, world: int, **kw) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(n, num_replicas=world, rank=r, **kw) for r in range(world)]


def interleave(per_rank: list[list[int]]) -> list[int]:
    """Per-rank batches of one step, back in global stream order (rank r holds offsets r, r+W, ...)."""
    assert len({len(b) for b in per_rank}) == 1, "ranks out of lockstep"
    return [b[i] for i in range(len(per_rank[0])) for b in per_rank]


def train(samplers: list[ResumableDistributedSampler], batch: int, steps: int) -> list[int]:
    """`steps` lockstep steps of `batch` samples per rank (shorter at an epoch's end), advancing
    after each; a new pass starts whenever the current one is exhausted, the way
    `while sampler.epoch < E: for b in loader: ...` would. Returns the global consumption."""
    consumed: list[int] = []
    its = [iter(s) for s in samplers]
    done = 0
    while done < steps:
        per_rank = [[i for _, i in zip(range(batch), it)] for it in its]
        if not per_rank[0]:  # end of a pass; advance() has already rolled the epoch over
            its = [iter(s) for s in samplers]
            continue
        consumed += interleave(per_rank)
        for s in samplers:
            s.advance(len(per_rank[s.rank]))
        done += 1
    return consumed


def one_pass(samplers: list[ResumableDistributedSampler]) -> list[list[int]]:
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n,world", [(1, 1), (10, 1), (10, 2), (12, 3), (10, 3), (7, 4), (16, 4), (5, 8), (2, 5)])
def test_one_pass_never_skips_or_repeats_within_an_epoch(n, world):
    samplers = ranks(n, world, seed=3)
    per_rank = one_pass(samplers)
    assert all(len(p) == len(s) == -(-n // world) for p, s in zip(per_rank, samplers))
    got = interleave(per_rank)
    # The whole epoch-0 permutation, in order, then the start of epoch 1 (and on, if n < world).
    assert got == stream(n, 3, seed=3)[: len(got)]
    assert sorted(got[:n]) == list(range(n))
    assert len(got) - n < world


@pytest.mark.parametrize("n,world", [(10, 1), (10, 2), (12, 3), (10, 3), (7, 4), (4, 4)])
def test_one_pass_with_drop_last_skips_only_the_tail(n, world):
    per_rank = one_pass(ranks(n, world, seed=3, drop_last=True))
    got = interleave(per_rank)
    assert got == epoch_order(n, 0, seed=3)[: n - n % world]
    assert len(set(got)) == len(got)


def test_unshuffled_pass_is_identity_order():
    assert interleave(one_pass(ranks(9, 3, shuffle=False))) == list(range(9))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize(
    "n,batch,steps_before,steps_after",
    [
        (23, 3, 2, 6),  # resumes mid-epoch 0; 2 then 3 ranks run on into epoch 1 and 2
        (23, 3, 4, 5),  # saved after the 2-rank run crossed the boundary (24 > 23)
        (20, 5, 2, 4),  # saved exactly at the end of epoch 0
        (31, 4, 3, 12),  # several boundaries after the resume
        (7, 2, 1, 9),  # tiny epochs: rounds of 6 straddle most boundaries
    ],
)
def test_restart_on_three_ranks_continues_the_two_rank_stream_exactly(n, batch, steps_before, steps_after, shuffle):
    before = ranks(n, 2, seed=11, shuffle=shuffle)
    first = train(before, batch, steps_before)
    saved = json.loads(json.dumps(before[0].state_dict()))  # what a checkpoint would hold
    assert all(s.state_dict() == saved for s in before)

    after = ranks(n, 3, seed=999, shuffle=not shuffle)  # seed/shuffle come from the checkpoint
    for s in after:
        s.load_state_dict(saved)
    second = train(after, batch, steps_after)

    whole = first + second
    assert whole == stream(n, len(whole) // n + 2, seed=11, shuffle=shuffle)[: len(whole)]
    # And the same as one uninterrupted single-rank run of the sampler.
    assert whole == train(ranks(n, 1, seed=11, shuffle=shuffle), 1, len(whole))
    epochs, position = divmod(len(whole), n)
    assert after[0].state_dict()["epoch"] == epochs and after[0].state_dict()["position"] == position


def test_restart_with_drop_last_continues_each_epoch_as_a_prefix():
    n = 23
    before = ranks(n, 2, seed=5, drop_last=True)
    first = train(before, 3, 3)  # 18 of epoch 0
    after = ranks(n, 3, seed=5, drop_last=True)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    assert len(after[0]) == (n - 18) // 3 == 1
    second = train(after, 3, 4)  # 3 more of epoch 0 (2 dropped), then all 7 rounds of epoch 1
    assert first + second[:3] == epoch_order(n, 0, seed=5)[:21]
    assert second[3:] == epoch_order(n, 1, seed=5)[:21]  # 23 % 3: 2 dropped again
    assert (after[0].epoch, after[0].position) == (2, 0)


def test_load_rolls_over_when_drop_last_leaves_nothing_for_the_new_world_size():
    s = ResumableDistributedSampler(10, num_replicas=4, rank=0, drop_last=True)
    s.load_state_dict({"epoch": 2, "position": 7, "seed": 0, "shuffle": True, "num_samples": 10})
    assert (s.epoch, s.position, len(s)) == (3, 0, 2)


def test_set_epoch_keeps_a_restored_or_rolled_over_position_and_resets_otherwise():
    n = 10
    s = ResumableDistributedSampler(n, num_replicas=4, rank=1, seed=2)
    s.advance(1)
    s.set_epoch(0)  # same epoch: a resumed loop re-setting it must not rewind
    assert (s.epoch, s.position, len(s)) == (0, 4, 2)
    s.advance(2)  # 4 + 8 = 12: the last round took 2 samples of epoch 1
    assert (s.epoch, s.position) == (1, 2)
    s.set_epoch(1)  # what `for epoch in range(...): set_epoch(epoch)` does next
    assert s.position == 2
    assert list(s) == rank_share(n, 4, 1, epoch=1, position=2, seed=2)
    s.set_epoch(5)
    assert (s.epoch, s.position) == (5, 0)
    assert list(s) == rank_share(n, 4, 1, epoch=5, position=0, seed=2)


def test_epoch_loop_with_set_epoch_resumes_exactly():
    """The DistributedSampler-style loop, stopped mid-epoch and resumed on another world size."""
    n, batch, epochs = 17, 2, 3

    def run(samplers, stop_after=None):
        consumed, steps = [], 0
        for epoch in range(samplers[0].epoch, epochs):
            for s in samplers:
                s.set_epoch(epoch)
            its = [iter(s) for s in samplers]
            while True:
                per_rank = [[i for _, i in zip(range(batch), it)] for it in its]
                if not per_rank[0] or steps == stop_after:
                    break
                consumed += interleave(per_rank)
                for s in samplers:
                    s.advance(len(per_rank[s.rank]))
                steps += 1
            if steps == stop_after:
                break
        return consumed

    before = ranks(n, 3, seed=1)
    first = run(before, stop_after=4)
    after = ranks(n, 2, seed=1)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    whole = first + run(after)
    # Epochs 0..2 in full, plus whatever the last round of epoch 2 took from epoch 3.
    assert whole == stream(n, epochs + 1, seed=1)[: len(whole)]
    assert n * epochs <= len(whole) < n * epochs + 2


class _Counting(Sampler[int]):
    """Passes a sampler through, counting the indices the DataLoader has pulled."""

    def __init__(self, inner):
        self.inner, self.pulled = inner, 0

    def __len__(self):
        return len(self.inner)

    def __iter__(self):
        for i in self.inner:
            self.pulled += 1
            yield i


def test_dataloader_prefetching_does_not_move_the_position():
    n, batch, world, stop = 101, 4, 2, 5
    sampler = ResumableDistributedSampler(n, num_replicas=world, rank=0, seed=7)
    counting = _Counting(sampler)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=counting, num_workers=2, prefetch_factor=2)
    consumed = []
    for step, b in enumerate(loader, 1):
        consumed += b.tolist()
        sampler.advance(len(b))  # what every rank does after its optimizer step
        assert sampler.state_dict()["position"] == step * batch * world
        if step == stop:
            break
    assert counting.pulled > stop * batch  # the loader really did run ahead of the loop
    order = epoch_order(n, 0, seed=7)
    assert consumed == order[0 : stop * batch * world : world]

    # A restart (here on one rank) picks up exactly after the last consumed round.
    resumed = ResumableDistributedSampler(n, num_replicas=1, rank=0)
    resumed.load_state_dict(sampler.state_dict())
    rest = [i for b in DataLoader(list(range(n)), batch_size=batch, sampler=resumed, num_workers=2) for i in b.tolist()]
    assert rest == order[stop * batch * world :]


def test_state_is_json_safe_identical_across_ranks_and_checkpointed_by_ftkit(tmp_path):
    samplers = ranks(50, 4, seed=123)
    train(samplers, 3, 6)  # 4 full steps + 1 round end epoch 0 (52: 2 into epoch 1), then 12 more
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)
    assert json.loads(json.dumps(states[0])) == states[0]
    assert states[0] == {"epoch": 1, "position": 14, "seed": 123, "shuffle": True, "num_samples": 50}

    with ftkit.Checkpointer({"sampler": samplers[0]}, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    fresh = ResumableDistributedSampler(50, num_replicas=3, rank=2)
    with ftkit.Checkpointer({"sampler": fresh}, [str(tmp_path)], rng=False) as ck:
        assert ck.restore() == 1
    assert fresh.state_dict() == states[0]
    assert list(fresh) == rank_share(50, 3, 2, epoch=1, position=14, seed=123)


def test_same_seed_gives_the_same_stream_in_another_process():
    code = (
        "import json; from ftkit.integrations.sampler import ResumableDistributedSampler as S; "
        "s = S(1000, num_replicas=3, rank=1, seed=42); s.set_epoch(4); s.advance(7); "
        "print(json.dumps(list(s)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = ResumableDistributedSampler(1000, num_replicas=3, rank=1, seed=42)
    here.set_epoch(4)
    here.advance(7)
    assert json.loads(out.stdout) == list(here) == rank_share(1000, 3, 1, epoch=4, position=21, seed=42)
    other_seed = ResumableDistributedSampler(1000, num_replicas=3, rank=1, seed=43)
    assert list(other_seed) != list(ResumableDistributedSampler(1000, num_replicas=3, rank=1, seed=42))


def test_len_is_what_remains_for_this_rank():
    s = ResumableDistributedSampler(10, num_replicas=3, rank=2)
    assert len(s) == len(list(s)) == 4
    s.advance(2)
    assert len(s) == len(list(s)) == 2
    d = ResumableDistributedSampler(10, num_replicas=3, rank=2, drop_last=True)
    assert len(d) == len(list(d)) == 3


def test_world_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    s = ResumableDistributedSampler(range(8))
    assert (s.num_replicas, s.rank, s.num_samples) == (4, 3, 8)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    s = ResumableDistributedSampler(8)
    assert (s.num_replicas, s.rank) == (1, 0)


def test_bad_arguments_and_foreign_state_are_refused():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        ResumableDistributedSampler(8, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="yield nothing"):
        ResumableDistributedSampler(3, num_replicas=4, rank=0, drop_last=True)
    with pytest.raises(ValueError, match="0 samples"):
        ResumableDistributedSampler([], num_replicas=1, rank=0)
    s = ResumableDistributedSampler(8, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="covered 9 samples, this one 8"):
        s.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "shuffle": True, "num_samples": 9})
    with pytest.raises(ValueError):
        s.advance(-1)
    assert (s.epoch, s.position) == (0, 0)
