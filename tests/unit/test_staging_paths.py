"""The CUDA staging path (side stream, fence, pinned slots, small tensors in order),
driven on CPU through a simulated device (tests/support/fakedevice.py).

The simulated device runs queued work in an adversarial order (its policies), so
a missing `wait_stream`, fence, event wait or in-order copy shows up as a wrong
staged value. The "sabotage" tests remove one guard at a time and check that the
same scenario then fails under at least one policy: these tests can fail.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from fakedevice import POLICIES, FakeDevice, FakeEvent, FakeStream

import ftkit
from ftkit.format.data import read_tensors
from ftkit.format.reader import load_manifest
from ftkit.save import capture as cap
from ftkit.save import staging
from ftkit.save.device import DeviceOps
from ftkit.save.layout import Layout
from ftkit.save.staging import Slot, StagingArena

BIG = 4096  # bytes: the threshold for a "large" tensor in these tests (1 MiB in ftkit)


@pytest.fixture(autouse=True)
def small_threshold(monkeypatch):
    monkeypatch.setattr(staging, "_SMALL_TENSOR_BYTES", BIG)


@pytest.fixture
def fake(monkeypatch):
    """make(policy): a simulated device that every new StagingArena uses; its persist thread is held."""
    made: list[FakeDevice] = []

    def make(policy: str, hold_background: bool = True) -> FakeDevice:
        dev = FakeDevice(policy, hold_background=hold_background)
        monkeypatch.setattr(staging, "DEVICE", dev)
        made.append(dev)
        return dev

    yield make
    for dev in made:  # never leave a persist thread blocked
        dev.background_gate.set()


def saved(path, step: int) -> dict[str, torch.Tensor]:
    storage = ftkit.Tier(str(path)).open()
    return read_tensors(storage, load_manifest(storage, step))


def values(state) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in cap.capture(state, rng=False).tensors}


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, f"{what}: {bad} differ"


class Net(torch.nn.Module):
    """A large weight (side stream) and a small buffer that "forward" updates in place."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(64, 64, generator=g))  # 16 KiB: large here
        self.register_buffer("running", torch.randn(16, generator=g))  # 64 B: small


class QueuedSGD(torch.optim.Optimizer):
    """SGD whose update is queued on the simulated current stream, like CUDA kernels.

    Optimizer step pre-hooks (ftkit's fence) run on the host when step() is called,
    before the update is queued: the order they have on a GPU.
    """

    def __init__(self, params, dev: FakeDevice, lr: float = 0.5):
        super().__init__(params, {"lr": lr})
        self.dev = dev

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad, lr = p.grad.clone(), group["lr"]
                    self.dev.launch(lambda p=p, grad=grad, lr=lr: p.data.add_(grad, alpha=-lr))


def training_scenario(dev: FakeDevice, tmp_path) -> tuple[list[dict], list[dict]]:
    """Two snapshots, each followed by a queued forward (buffer update) and a fenced optimizer step.

    Returns (what was saved, what should have been) for steps 1 and 2.
    """
    net = Net()
    opt = QueuedSGD(net.parameters(), dev)
    dev.put(net)
    state = {"model": net, "optim": opt}
    net.w.grad = torch.full_like(net.w, 0.25)
    want = [values(state)]
    ck = ftkit.Checkpointer(state, [str(tmp_path)], rng=False)
    try:
        for step in (1, 2):
            assert ck.snapshot(step)
            dev.launch(lambda: net.running.add_(1.0))  # forward: BatchNorm-like in-place update
            opt.step()  # the fence, then the queued update of the large weight
            nxt = {k: v.clone() for k, v in want[-1].items()}
            nxt["model/running"] += 1.0
            nxt["model/w"] -= 0.5 * 0.25
            want.append(nxt)
        dev.background_gate.set()
        ck.wait()
    finally:
        dev.background_gate.set()
        ck.close()
    dev.drain()
    assert_equal(values(state), want[2], "live state after the queued work")  # the scenario itself is right
    return [saved(tmp_path, 1), saved(tmp_path, 2)], want[:2]


@pytest.mark.parametrize("policy", POLICIES)
def test_snapshots_are_consistent_under_every_schedule(fake, tmp_path, policy):
    got, want = training_scenario(fake(policy), tmp_path)
    assert_equal(got[0], want[0], "step 1")
    assert_equal(got[1], want[1], "step 2 (staged while step 1's copy could still be in flight)")


def _fails_somewhere(fake, tmp_path, policies=POLICIES) -> list[str]:
    failed = []
    for policy in policies:
        got, want = training_scenario(fake(policy), tmp_path / policy)
        if any(not torch.equal(g[n], w[n]) for g, w in zip(got, want) for n in w):
            failed.append(policy)
    return failed


def test_sabotage_no_wait_for_the_current_stream_is_caught(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeStream, "wait_stream", lambda self, other: None)
    assert "side_first" in _fails_somewhere(fake, tmp_path)


def test_sabotage_no_fence_is_caught(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(Slot, "fence", lambda self: None)
    assert "current_first" in _fails_somewhere(fake, tmp_path)


def test_sabotage_background_not_waiting_for_the_copy_is_caught(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeEvent, "synchronize", lambda self: None)
    assert "lazy" in _fails_somewhere(fake, tmp_path, ["lazy"])


def test_sabotage_small_tensors_on_the_side_stream_is_caught(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "_SMALL_TENSOR_BYTES", 0)  # the buffer would go on the side stream...
    real_fill = Slot.fill  # ...unless named in_order (module buffers, when the Checkpointer names them)
    monkeypatch.setattr(
        Slot, "fill", lambda self, named, side_stream=None, in_order=(): real_fill(self, named, side_stream)
    )
    assert "current_first" in _fails_somewhere(fake, tmp_path)


# ------------------------------------------------ with real PyTorch modules
def test_real_optimizer_and_batchnorm_forward_do_not_leak(fake, tmp_path):
    """Host-side writes (a real forward and torch.optim.SGD) act as work on the current stream."""
    dev = fake("current_first")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()  # forward updates BatchNorm's stats
        opt.step()

    train()
    dev.put(model, opt)
    state = {"model": model, "optim": opt}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        want = values(state)
        ck.snapshot(1)
        train()
        after = values(state)
        dev.background_gate.set()
        ck.wait()
    got = saved(tmp_path, 1)
    assert_equal(got, want, "snapshot")
    changed = [n for n in want if not torch.equal(want[n], after[n])]
    assert "model/0.weight" in changed and "model/1.running_mean" in changed  # the probe did probe


def test_direct_write_outside_the_optimizer_needs_the_fence(fake, tmp_path):
    """Documented: an in-place write to a large tensor outside the fenced optimizer step,
    before it, is NOT guarded; after the fence it is."""
    for fenced in (False, True):
        dev = fake("current_first")
        net = Net()
        dev.put(net)
        path = tmp_path / str(fenced)
        with ftkit.Checkpointer({"model": net}, [str(path)], rng=False) as ck:
            before = net.w.detach().clone()
            ck.snapshot(1)
            if fenced:
                ck.fence()  # what optimizer.step() runs first
            net.w.data.mul_(2.0)  # e.g. an EMA or weight projection before the next step
            dev.background_gate.set()
            ck.wait()
        got = saved(path, 1)["model/w"]
        assert torch.equal(got, before if fenced else 2.0 * before), f"fenced={fenced}"


# ------------------------------------------------------------ the Slot API
def _arena(dev: FakeDevice, pin: bool | None = None) -> StagingArena:
    return StagingArena(slots=2, pin=pin, ops=dev)


def test_copies_go_where_the_design_says(fake):
    dev = fake("lazy", hold_background=False)
    big, small, order, host = torch.randn(4096), torch.randn(8), torch.randn(4096), torch.randn(4096)
    other = torch.randn(4096)
    dev.put(big, small, order)
    dev.put(other, device="fake:1")
    named = [("big", big), ("small", small), ("order", order), ("host", host), ("other", other)]
    for pin in (True, False):
        dev.copies.clear()
        arena = _arena(dev, pin)
        slot = arena.acquire(Layout.of(named), wait=True)
        slot.fill(named, in_order={"order"})
        side = arena.side_stream().name
        streams = [(c.stream, c.nbytes, c.non_blocking, c.kind) for c in dev.copies]
        assert streams[:2] == [("default@fake:0", 32, pin, "d2h"), ("default@fake:0", 16384, pin, "d2h")]
        assert streams[2] == ("default@fake:1", 16384, pin, "d2h")  # the side stream belongs to fake:0
        assert streams[3] == (side, 16384, pin, "d2h")
        assert len(streams) == 4  # the CPU tensor is copied on the host, not queued
        assert torch.equal(slot.views["host"], host)  # ... at once
        arena.release(slot)  # waits for the rest
        for name, t in named:
            assert torch.equal(slot.views[name], t), name
        arena.close()


def test_closing_the_arena_frees_every_slot_when_one_slots_copies_failed(fake):
    class BrokenEvent:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dev = fake("lazy", hold_background=False)
    w = torch.randn(4096)
    arena = _arena(dev)
    a = arena.acquire(Layout.of([("w", w)]), wait=True)
    a.fill([("w", w)])
    b = arena.acquire(Layout.of([("w", w)]), wait=True)
    b.fill([("w", w)])
    assert a.capacity and b.capacity
    a._events = [BrokenEvent()]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        arena.close()
    assert a.capacity == 0 and b.capacity == 0  # both buffers given back
    # A slot whose copies failed when it was released, dropped later for a bigger snapshot:
    # the acquire goes on (the error was raised at the release).
    tight = StagingArena(slots=2, budget_bytes=20000, ops=dev)
    small = Layout.of([("s", torch.randn(8))])
    a, b = tight.acquire(small, wait=True), tight.acquire(small, wait=True)
    b._events = [BrokenEvent()]
    tight.release(a)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tight.release(b)
    got = tight.acquire(Layout.of([("w", w)]), wait=True)  # one 16 KiB slot fits the budget
    assert got is a and got.busy and b.capacity == 0 and tight._slots == [a]
    tight.release(got)
    tight.close()


def test_every_fill_records_the_fence_event_so_a_newer_slot_covers_an_older_one(fake):
    dev = fake("current_first", hold_background=False)
    w, s = torch.randn(4096), torch.randn(8)
    dev.put(w, s)
    arena = _arena(dev)
    a = arena.acquire(Layout.of([("w", w)]), wait=True)
    a.fill([("w", w)])
    b = arena.acquire(Layout.of([("s", s)]), wait=True)
    b.fill([("s", s)])  # nothing large: nothing of its own on the side stream
    before = w.clone()
    b.fence()  # what the optimizer step runs for the newest snapshot only
    w.mul_(3.0)
    a.ready()
    assert torch.equal(a.views["w"], before)
    arena.close()


def test_fence_makes_the_current_stream_wait_and_ready_waits_for_everything(fake):
    dev = fake("lazy", hold_background=False)
    w, s = torch.randn(4096), torch.randn(8)
    dev.put(w, s)
    arena = _arena(dev)
    slot = arena.acquire(Layout.of([("w", w), ("s", s)]), wait=True)
    slot.fill([("w", w), ("s", s)])
    side, current = arena.side_stream(), dev.current_stream()
    assert side.pending() == 2 and current.pending() == 1  # wait for current + large copy; the small copy
    assert slot.in_flight()
    slot.fence()
    assert current.queue[-1][0] == "wait" and current.queue[-1][1] is slot._fence_event
    slot.ready()
    assert side.pending() == 0 and not slot.in_flight()
    assert torch.equal(slot.views["w"], w) and torch.equal(slot.views["s"], s)
    slot.fence()  # after ready(): nothing left to wait for
    assert current.queue[-1][1] is not None and current.pending() == 1  # the earlier wait only
    arena.close()


def test_sources_live_until_ready_and_no_longer(fake):
    dev = fake("lazy", hold_background=False)
    arena = _arena(dev)
    tmp = torch.randn(4096)  # e.g. a tensor state_dict() made for this snapshot only
    dev.put(tmp)
    want = tmp.clone()
    ref = weakref.ref(tmp)
    slot = arena.acquire(Layout.of([("t", tmp)]), wait=True)
    slot.fill([("t", tmp)])
    del tmp
    gc.collect()
    assert ref() is not None  # the copy has not run: its source must not be freed
    slot.ready()
    gc.collect()
    assert ref() is None  # and once it ran, the slot does not hold it
    assert torch.equal(slot.views["t"], want)
    arena.close()


def test_a_slot_released_unread_is_complete_before_reuse(fake):
    dev = fake("lazy", hold_background=False)
    w = torch.randn(4096)
    dev.put(w)
    arena = StagingArena(slots=1, ops=dev)
    slot = arena.acquire(Layout.of([("w", w)]), wait=True)
    slot.fill([("w", w)])
    arena.release(slot)  # e.g. the persist job failed before reading the slot
    assert not slot.in_flight() and torch.equal(slot.views["w"], w)
    again = arena.acquire(Layout.of([("w", w)]), wait=True)
    assert again is slot and dev.allocs == [slot.capacity]  # reused, not reallocated
    again.fill([("w", w)])
    first = list(again._events)
    assert first and not all(e.query() for e in first)  # queued, not run (lazy)
    again.fill([("w", w)])  # a fill whose copies nobody waited for: they land before new ones queue
    assert all(e.query() for e in first)
    arena.release(again)
    arena.close()
    assert dev.frees == len(dev.allocs) == 1


def test_a_failing_fill_leaves_nothing_in_flight(fake, monkeypatch):
    dev = fake("lazy", hold_background=False)
    a, b = torch.randn(4096), torch.randn(4096)
    dev.put(a, b)
    arena = _arena(dev)
    real_copy = dev.copy

    def copy(dst, src, non_blocking):
        if src is b:
            raise RuntimeError("CUDA error: an illegal memory access")
        real_copy(dst, src, non_blocking)

    monkeypatch.setattr(dev, "copy", copy)
    named = [("a", a), ("b", b)]
    slot = arena.acquire(Layout.of(named), wait=True)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        slot.fill(named)
    assert arena.side_stream().pending() == 0  # the copy of `a` that was queued has finished
    arena.release(slot)
    arena.close()


def test_upload_copies_to_the_device_and_waits(fake):
    dev = fake("lazy", hold_background=False)
    live, host_live = torch.zeros(4096), torch.zeros(8)
    dev.put(live)
    arena = _arena(dev)
    named = [("live", torch.randn(4096)), ("host", torch.randn(8))]
    slot = arena.acquire(Layout.of(named), wait=True)
    slot.fill(named)
    slot.upload({"live": live, "host": host_live})
    assert torch.equal(live, named[0][1]) and torch.equal(host_live, named[1][1])
    assert [(c.kind, c.non_blocking) for c in dev.copies] == [("h2d", True)]
    assert dev.current_stream().pending() == 0
    arena.close()


def test_checkpointer_reuses_its_slots_and_frees_them(fake, tmp_path):
    dev = fake("current_first", hold_background=False)
    net = Net()
    dev.put(net)
    with ftkit.Checkpointer({"model": net}, [ftkit.Tier(str(tmp_path), keep=1)], rng=False) as ck:
        for step in range(1, 6):
            ck.snapshot(step)
            ck.wait()
        assert len(dev.allocs) == 1  # one slot was enough, allocated once
        assert all(s.pinned_by == "fake-pinned" for s in ck._arena._slots if s.capacity)
    assert dev.frees == len(dev.allocs)


def test_background_and_training_threads_share_the_device(fake, tmp_path):
    """Many snapshots with the persist thread running freely: no deadlock, every step right."""
    dev = fake("lazy", hold_background=False)
    net = Net()
    opt = QueuedSGD(net.parameters(), dev)
    dev.put(net)
    net.w.grad = torch.ones_like(net.w)
    want = [net.w.detach().clone()]  # the same float operations, in the same order
    for _ in range(8):
        want.append(want[-1].clone().add_(net.w.grad, alpha=-0.5))
    with ftkit.Checkpointer({"model": net, "optim": opt}, [ftkit.Tier(str(tmp_path), keep=10)], rng=False) as ck:
        for step in range(1, 9):
            ck.snapshot(step)
            opt.step()
    dev.drain()
    for step in range(1, 9):
        assert torch.equal(saved(tmp_path, step)["model/w"], want[step - 1]), step
    assert torch.equal(net.w.detach(), want[8])


# ------------------------------------------------- the real DeviceOps, on CPU
def test_pinning_registers_exactly_the_bytes_asked_and_unregisters(monkeypatch):
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)
    ops = DeviceOps()
    buf, how = ops.alloc_host(3 * 2**20 + 5, pin=True)
    assert how == "registered" and buf.numel() == 3 * 2**20 + 5  # no rounding to a power of two
    assert calls == [("register", buf.data_ptr(), 3 * 2**20 + 5, 1)]  # portable
    ops.free_host(buf, how)
    assert calls[-1] == ("unregister", buf.data_ptr())
    plain, how = ops.alloc_host(100, pin=False)
    assert how is None and plain.numel() == 100


def test_pinning_falls_back_to_the_allocator_when_registering_fails(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    real_empty = torch.empty
    asked = []

    def empty(*args, **kwargs):
        asked.append(kwargs.get("pin_memory", False))
        kwargs.pop("pin_memory", None)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    buf, how = DeviceOps().alloc_host(4096, pin=True)
    assert how == "allocator" and asked == [False, True]


def test_without_a_device_nothing_changes_on_cpu(tmp_path):
    """The real DeviceOps on this CPU-only machine: no side stream, synchronous copies."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    arena = StagingArena(slots=1)
    assert arena.side_stream() is None and arena.pin is False
    named = [("w", torch.randn(4096))]
    slot = arena.acquire(Layout.of(named), wait=True)
    slot.fill(named)
    assert not slot.in_flight() and torch.equal(slot.views["w"], named[0][1])
    slot.fence()
    slot.ready()
    arena.release(slot)
    arena.close()


def test_threads_see_one_current_stream_each(fake):
    """The simulated device keeps the current stream per thread, as CUDA does."""
    dev = fake("lazy", hold_background=False)
    side = dev.new_stream()
    seen = []
    with dev.use(side):
        t = threading.Thread(target=lambda: seen.append(dev.current_stream().name))
        t.start()
        t.join()
        assert dev.current_stream() is side
    assert seen == ["default@fake:0"]


# ------------------------------------------------------------ restore's side
def test_host_targets_reads_device_tensors_through_a_pinned_slot(fake):
    dev = fake("lazy", hold_background=False)
    live, host = torch.zeros(4096), torch.zeros(8)
    dev.put(live)
    arena = _arena(dev)
    with arena.host_targets({"d": live, "h": host}) as t:
        assert t["h"] is host and not dev.on_device(t["d"])  # device tensors: a host view to read into
        t["d"].copy_(torch.arange(4096.0))
        t["h"].fill_(3.0)
        assert not live.any()  # nothing reaches the device before the reading is done
    assert torch.equal(live, torch.arange(4096.0)) and torch.equal(host, torch.full((8,), 3.0))
    assert [(c.kind, c.non_blocking) for c in dev.copies] == [("h2d", True)]
    assert dev.current_stream().pending() == 0  # waited for
    slot = next(s for s in arena._slots if s.capacity)
    assert not slot.busy and slot.capacity >= 16384 + 32 + (1 << 20)  # room for the host tensors, RNG
    named = [("d", live), ("h", host), ("_rng/r0/torch", torch.zeros(5056, dtype=torch.uint8))]
    again = arena.acquire(Layout.of(named), wait=True)  # the first snapshot after a restore
    assert again is slot and len(dev.allocs) == 1  # reuses it
    arena.release(again)
    arena.close()


def test_host_targets_copies_nothing_when_reading_fails(fake):
    dev = fake("lazy", hold_background=False)
    live = torch.zeros(4096)
    dev.put(live)
    arena = _arena(dev)
    with pytest.raises(ValueError, match="bad chunk"):
        with arena.host_targets({"d": live}) as t:
            t["d"].fill_(1.0)
            raise ValueError("bad chunk")
    assert not live.any() and not dev.copies and not any(s.busy for s in arena._slots)
    arena.close()
    with arena.host_targets({"d": live}) as t:  # a closed arena: a temporary slot, freed after
        t["d"].fill_(2.0)
    assert torch.equal(live, torch.full((4096,), 2.0)) and dev.frees == len(dev.allocs) == 2
    tight = StagingArena(slots=2, budget_bytes=20000, ops=dev)  # one snapshot fits, the spare room not
    with tight.host_targets({"d": live}) as t:
        t["d"].fill_(4.0)
    assert torch.equal(live, torch.full((4096,), 4.0)) and not tight._slots and dev.frees == 3
    tight.close()


def test_restore_into_device_tensors_goes_through_pinned_memory(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FTKIT_RAM_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("FTKIT_JOB_ID", "staging-paths")
    dev = fake("current_first", hold_background=False)
    net = Net()
    dev.put(net)
    opt = torch.optim.Adam(net.parameters())
    net.w.grad = torch.ones_like(net.w)
    opt.step()
    dev.put(opt)
    state = {"model": net, "optim": opt}
    for url in ("ram", str(tmp_path / "dir")):
        with ftkit.Checkpointer(state, [url], rng=False) as ck:
            ck.snapshot(1)
            want = values(state)
        net2 = Net()
        net2.w.data.zero_()
        opt2 = torch.optim.Adam(net2.parameters())
        net2.w.grad = torch.ones_like(net2.w)
        opt2.step()
        dev.put(net2, opt2)
        state2 = {"model": net2, "optim": opt2}
        dev.copies.clear()
        allocs = len(dev.allocs)
        with ftkit.Checkpointer(state2, [url], rng=False) as ck:
            assert ck.restore() == 1
            assert_equal(values(state2), want, f"restored from {url}")
            h2d = [c for c in dev.copies if c.kind == "h2d"]
            assert sum(c.nbytes for c in h2d) == sum(
                v.numel() * v.element_size() for n, v in want.items() if n != "optim/state/0/step"
            )
            # Two pinned slots: the live state's undo copy (restore/undo.py) and the bounce slot
            # the saved bytes came through...
            assert len(dev.allocs) == allocs + 2
            for step in (2, 3):
                ck.snapshot(step)
                ck.wait()
            assert len(dev.allocs) == allocs + 2  # ...are the slots the snapshots after it use


def test_an_optimizer_outside_the_state_is_fenced_too(fake, tmp_path):
    dev = fake("current_first")
    net = Net()
    dev.put(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)  # not given to the Checkpointer
    net.w.grad = torch.ones_like(net.w)
    with ftkit.Checkpointer({"model": net}, [str(tmp_path)], rng=False) as ck:
        want = values({"model": net})
        ck.snapshot(1)
        opt.step()
        dev.background_gate.set()
        ck.wait()
    assert_equal(saved(tmp_path, 1), want, "snapshot")


def test_large_module_buffers_are_copied_in_stream_order(fake, tmp_path):
    dev = fake("current_first")
    net = Net()
    net.register_buffer("stats", torch.randn(4096))  # 16 KiB: large here, updated by "forward"
    dev.put(net)
    with ftkit.Checkpointer({"model": net}, [str(tmp_path)], rng=False) as ck:
        want = values({"model": net})
        ck.snapshot(1)
        net.stats.add_(1.0)  # forward, before any optimizer step
        dev.background_gate.set()
        ck.wait()
    assert_equal(saved(tmp_path, 1), want, "snapshot")


def test_the_arena_never_holds_more_than_its_budget_when_sizes_change():
    """Snapshot sizes change (optimizer state appears, buffers shrink and grow) while slots
    are busy: every acquire keeps the arena's memory within max_staging_bytes, waiting (here:
    returning None) when the busy slots leave no room, and gives free slots' buffers back
    when it must."""
    import random

    rng = random.Random(7)
    budget = 20_000
    arena = StagingArena(slots=2, budget_bytes=budget, pin=False)
    held: list[Slot] = []
    got = 0
    for _ in range(400):
        if held and (len(held) == 2 or rng.random() < 0.5):
            arena.release(held.pop(rng.randrange(len(held))))
        size = rng.randrange(3_000, 12_001)
        slot = arena.acquire(Layout.of([("w", torch.zeros(size, dtype=torch.uint8))]), wait=False)
        assert arena.nbytes <= budget, [s.capacity for s in arena._slots]
        if slot is not None:
            assert slot.capacity >= size
            held.append(slot)
            got += 1
    assert got > 200  # (most acquires find room)
    for s in held:
        arena.release(s)
    arena.close()
