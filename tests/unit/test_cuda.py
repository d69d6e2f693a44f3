"""The CUDA path on a real GPU: pinned slots, the side-stream copy, the optimizer
fence, small tensors in order, CUDA RNG, restore into CUDA tensors. Skipped
without CUDA.

The probes do not rely on luck: before a snapshot, the side stream (or the
current stream) is given a ~100 ms sleep kernel, so the device-to-host copy is
certainly still queued when the training code writes, and a missing guard shows
as a wrong staged value. The tests check that the probe did probe (the copy's
event not yet complete), not how long anything took.

``FTKIT_CUDA_TESTS_ON_CPU=1`` runs the same tests on the CPU (no side stream:
every copy is synchronous, the sleeps are skipped) to check the tests themselves
on a machine without a GPU; see also tests/unit/test_staging_paths.py.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import ftkit
from ftkit.format.data import read_tensors
from ftkit.format.reader import load_manifest
from ftkit.save import capture as cap

ON_CPU = os.environ.get("FTKIT_CUDA_TESTS_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not ON_CPU,
    reason="no CUDA device (FTKIT_CUDA_TESTS_ON_CPU=1 runs these on the CPU)",
)
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
SLEEP_MS = 100


@pytest.fixture(autouse=True)
def ram_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("FTKIT_JOB_ID", f"cuda-{uuid.uuid4().hex[:8]}")


_CYCLES_PER_MS: list[float] = []


def busy(stream, ms: float = SLEEP_MS):
    """Queue a sleep kernel of about `ms` on `stream`; returns an event recorded after it (None on CPU)."""
    if not CUDA:
        return None
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / max(start.elapsed_time(end), 1e-3))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))
        ev = torch.cuda.Event()
        ev.record(stream)
    return ev


def side(ck):
    """The stream the Checkpointer's large copies go on."""
    return ck._arena.side_stream()


def current():
    return torch.cuda.current_stream() if CUDA else None


def still_copying(ck) -> bool:
    """Whether the newest snapshot's side-stream copy has not finished yet (the probe is live)."""
    slot = ck._unfenced
    return slot is not None and slot._fence_event is not None and not slot._fence_event.query()


def make(dtype=torch.float32, seed: int = 0):
    """Linear layers large enough for the side stream (>= 1 MiB in bf16 too), BatchNorm, Adam."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    ).to(DEV, dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def train(model, opt, steps: int = 1) -> None:
    p = next(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(64, 512, device=DEV, dtype=p.dtype)).float().square().mean().backward()
        opt.step()


def values(state) -> dict[str, torch.Tensor]:
    """Every tensor of the state, as it is now, on the host."""
    return {n: t.detach().cpu().clone() for n, t in cap.capture(state, rng=False).tensors}


def saved(path, step: int) -> dict[str, torch.Tensor]:
    storage = ftkit.Tier(str(path)).open()
    return read_tensors(storage, load_manifest(storage, step))


def assert_equal(got, want, what: str) -> None:
    missing = sorted(set(want) - set(got))
    assert not missing, f"{what}: not saved: {missing[:5]}"
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:5]}"


def large(model) -> torch.Tensor:
    return model[0].weight  # 512 x 1024: >= 1 MiB in fp32 and bf16


# ------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("tier", ["ram", "dir"])
def test_restore_into_cuda_tensors_is_bitwise_exact(tmp_path, dtype, tier):
    url = "ram" if tier == "ram" else str(tmp_path / "ckpt")
    model, opt = make(dtype)
    train(model, opt, 2)
    state = {"model": model, "optim": opt, "step": 2}
    with ftkit.Checkpointer(state, [url]) as ck:
        ck.snapshot(2)
        want = values(state)
    model2, opt2 = make(dtype, seed=1)
    train(model2, opt2)  # a live optimizer state to load into, different from the saved one
    state2 = {"model": model2, "optim": opt2, "step": 0}
    assert any(not torch.equal(want[n], v) for n, v in values(state2).items() if n in want)
    with ftkit.Checkpointer(state2, [url]) as ck2:
        assert ck2.restore() == 2
        assert ck2.last_restore["source"] == ("ram" if tier == "ram" else ck2._backends[0].display_url)
    assert state2["step"] == 2
    assert_equal(values(state2), want, f"restored from {tier}")
    assert all(p.device.type == DEV and p.dtype == dtype for p in model2.parameters())
    assert all(v.device.type == DEV for st in opt2.state.values() for k, v in st.items() if k != "step")
    train(model2, opt2)  # and training goes on from it


# ------------------------------------------------ the consistency probes
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_optimizer_step_right_after_snapshot_does_not_leak(tmp_path, dtype):
    model, opt = make(dtype)
    train(model, opt)
    state = {"model": model, "optim": opt}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        want = values(state)
        busy(side(ck))  # the copy waits ~100 ms behind this
        ck.snapshot(1)
        if CUDA:
            assert still_copying(ck)
        train(model, opt)  # forward (BatchNorm stats), backward, the fenced optimizer step
        ck.wait()
    after = values(state)
    assert not torch.equal(after["model/0.weight"], want["model/0.weight"])  # the step did write
    assert_equal(saved(tmp_path, 1), want, "snapshot")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_direct_writes_outside_the_optimizer(tmp_path, dtype):
    """Documented behaviour (ftkit/save/staging.py): an in-place write to a large tensor between
    snapshot() and the next optimizer step, outside that step, is NOT guarded unless the
    fence runs first; small tensors are guarded by stream order."""
    model, opt = make(dtype)
    train(model, opt)
    # The write's kernel, launched once first: CUDA loads kernels lazily, and a first launch waits
    # for the work in flight (the busy side stream), which would hide the race this probe shows.
    large(model).detach().clone().mul_(2)
    state = {"model": model, "optim": opt}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        # Unfenced: p.data.mul_() right after snapshot() reaches the queued copy.
        want1 = values(state)
        busy(side(ck))
        ck.snapshot(1)
        if CUDA:
            assert still_copying(ck)
        large(model).data.mul_(2)  # e.g. a weight projection or an EMA update before the step
        model[0].bias.data.add_(1)  # a small tensor: copied on the current stream, in order
        ck.wait()
        # Fenced: what the optimizer step pre-hook runs, called before the write.
        want2 = values(state)
        busy(side(ck))
        ck.snapshot(2)
        ck.fence()  # what every optimizer step runs first
        large(model).data.mul_(2)
        ck.wait()
    got1, got2 = saved(tmp_path, 1), saved(tmp_path, 2)
    leaked = want1["model/0.weight"] * 2
    assert torch.equal(got1["model/0.weight"], leaked if CUDA else want1["model/0.weight"]), (
        "unfenced write: expected the documented leak on CUDA (none on CPU)"
    )
    assert torch.equal(got1["model/0.bias"], want1["model/0.bias"])
    assert_equal(got2, want2, "fenced write")


def test_batchnorm_stats_updated_by_the_next_forward_are_as_of_the_snapshot(tmp_path):
    model, opt = make()
    train(model, opt)
    bn = model[1]
    with ftkit.Checkpointer({"model": model}, [str(tmp_path)], rng=False) as ck:
        before = {k: v.detach().cpu().clone() for k, v in bn.state_dict().items()}
        busy(side(ck))
        ck.snapshot(1)
        model(torch.randn(64, 512, device=DEV))  # training mode: updates the running stats in place
        ck.wait()
    got = saved(tmp_path, 1)
    assert not torch.equal(bn.running_mean.cpu(), before["running_mean"])
    for k, v in before.items():
        assert torch.equal(got[f"model/1.{k}"], v), k


def test_side_copy_waits_for_work_already_queued_on_the_current_stream(tmp_path):
    w = torch.zeros(1 << 20, device=DEV)  # 4 MiB: the side stream
    with ftkit.Checkpointer({"w": w}, [str(tmp_path)], rng=False) as ck:
        busy(current())  # the write below runs only after ~100 ms
        w.add_(1.0)
        ck.snapshot(1)
        ck.wait()
    assert torch.equal(saved(tmp_path, 1)["w"], torch.ones(1 << 20))


def test_snapshot_does_not_wait_for_the_gpu(tmp_path):
    model, opt = make()
    train(model, opt)
    with ftkit.Checkpointer({"model": model, "optim": opt}, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)  # the first allocates the pinned slot
        ck.wait()
        busy_ev = busy(current())
        ck.snapshot(2)
        if CUDA:  # no host-side synchronization in snapshot(): the queued sleep is still running
            assert not busy_ev.query()
        ck.wait()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_snapshot_while_the_previous_copy_is_still_running(tmp_path, dtype):
    model, opt = make(dtype)
    train(model, opt)
    state = {"model": model, "optim": opt}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(tmp_path), keep=5)], rng=False) as ck:
        want1 = values(state)
        busy(side(ck), 2 * SLEEP_MS)
        ck.snapshot(1)
        train(model, opt)  # fenced: its optimizer step waits (on the GPU) for the first copy
        want2 = values(state)  # synchronizes the host with the current stream, not the side stream
        busy(side(ck))
        ck.snapshot(2)  # the second slot; its copies queue behind the first's
        if CUDA:
            assert still_copying(ck)
        train(model, opt)
        ck.wait()
    assert_equal(saved(tmp_path, 1), want1, "step 1")
    assert_equal(saved(tmp_path, 2), want2, "step 2")


class Temporary:
    """A stateful object whose state_dict() makes a new (large) tensor every time."""

    def __init__(self):
        self.x = torch.randn(1 << 20, device=DEV)

    def state_dict(self):
        return {"t": self.x * 1}

    def load_state_dict(self, sd):
        self.x.copy_(sd["t"])


def test_a_temporary_from_state_dict_lives_until_it_is_copied(tmp_path):
    obj = Temporary()
    with ftkit.Checkpointer({"obj": obj}, [str(tmp_path)], rng=False) as ck:
        busy(side(ck))
        ck.snapshot(1)
        # Freed too early, the temporary's block would go to these (same size, same stream).
        junk = [torch.full_like(obj.x, float(i)) for i in range(8)]
        ck.wait()
    del junk
    assert torch.equal(saved(tmp_path, 1)["obj/t"], obj.x.cpu())


def test_pinned_slots_are_registered_at_their_size_and_reused(tmp_path):
    model, opt = make()
    train(model, opt)
    with ftkit.Checkpointer({"model": model, "optim": opt}, [ftkit.Tier(str(tmp_path), keep=1)], rng=False) as ck:
        ptrs = set()
        for step in range(1, 4):
            ck.snapshot(step)
            ck.wait()
            ptrs |= {s.buffer.data_ptr() for s in ck._arena._slots if s.capacity}
        slots = [s for s in ck._arena._slots if s.capacity]
        assert len(slots) == 1 and len(ptrs) == 1  # one slot, allocated once
        slot = slots[0]
        assert slot.capacity == slot.layout.total_bytes == slot.buffer.numel()
        if CUDA:
            assert slot.buffer.is_pinned()
            assert slot.pinned_by == "registered", f"pinned by {slot.pinned_by}: cudaHostRegister failed"


# -------------------------------------------------------------------- RNG
def test_cuda_rng_continues_after_restore(tmp_path):
    model, opt = make()
    state = {"model": model, "optim": opt, "step": 0}
    torch.manual_seed(1234)
    train(model, opt)
    with ftkit.Checkpointer(state, [str(tmp_path)]) as ck:
        ck.snapshot(1)
        ck.wait()
        draws = (
            torch.randn(8, device=DEV).cpu(),
            torch.randn(8).clone(),
            torch.nn.functional.dropout(torch.ones(64, device=DEV), 0.5).cpu(),
        )
        torch.manual_seed(99)  # move every RNG elsewhere
        torch.randn(1000, device=DEV)
        assert ck.restore() == 1
        again = (
            torch.randn(8, device=DEV).cpu(),
            torch.randn(8).clone(),
            torch.nn.functional.dropout(torch.ones(64, device=DEV), 0.5).cpu(),
        )
    for a, b in zip(draws, again):
        assert torch.equal(a, b)
