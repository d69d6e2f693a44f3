"""The staging arena: reused host buffers the training state is copied into (copying into
fresh memory is much slower: page faults). Two slots give double buffering; when the
memory budget fits one, snapshots serialize on it. Order of calls::

    layout = Layout.of(named_tensors)         # pure plan: offsets in one flat buffer
    slot = arena.acquire(layout, wait=...)    # None when busy and not waiting
    slot.fill(named_tensors)                  # the training stall (CPU); async on CUDA
    ...training: the next optimizer.step() calls slot.fence() first...
    ...background: slot.ready() ... read slot.views / slot.buffer ...
    arena.release(slot)                       # waits for the copies too, should ready() not have run

On CUDA (every device call goes through save/device.py :class:`DeviceOps`):

* Slots are pinned with ``cudaHostRegister`` at their exact size (torch's pinned
  allocator, the fallback, rounds up to a power of two).
* Large device tensors (>= 1 MiB, on the side stream's device, not ``in_order``) are
  copied on a side stream after ``side.wait_stream(current)`` (the optimizer step may
  still run). :meth:`Slot.fence` makes the current stream wait for an event recorded
  after them at every fill, so fencing the newest slot also covers older copies.
* Other device tensors (small ones, like BatchNorm statistics that forward updates in
  place, and ``in_order`` ones) go on their device's current stream, in program order,
  so a later update cannot leak in. CPU tensors are copied at once.
* Sources stay referenced until :meth:`Slot.ready` saw the copies finish (the caching
  allocator could reuse a ``state_dict()`` temporary). Events are ``blocking=True``.

NOT guarded against: an in-place GPU write to a large tensor that is not ``in_order``,
between ``fill`` and the next fence, outside an ``optimizer.step()`` with the fence
pre-hook (an EMA, ``p.data.mul_()``): such code must call the fence first."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch

from ftkit.errors import ConfigError, FtkitError
from ftkit.save.device import DeviceOps
from ftkit.save.layout import Layout

_SMALL_TENSOR_BYTES = 1 << 20


DEVICE: DeviceOps = DeviceOps()


class Slot:
    """One staging buffer and what is staged in it."""

    def __init__(self, pin: bool, ops: DeviceOps, side_stream: Any = None):
        self.pin = pin
        self.ops = ops
        self._side = side_stream  # a callable giving the arena's side stream, or None
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.pinned_by: str | None = None  # "registered", "allocator" or None (pageable)
        self.layout: Layout | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.busy = False
        self._events: list[Any] = []  # what ready() waits for: every copy of the last fill
        self._fence_event: Any = None  # side-stream event the next optimizer step must wait for
        self._fence_device: Any = None
        self._sources: list[torch.Tensor] = []  # kept alive until the copies are done

    def _ensure(self, layout: Layout) -> None:
        """Size the buffer for `layout` and make its views."""
        if layout.total_bytes > self.capacity:
            self.ready()  # nothing may still be copying into the old buffer
            self._free_buffer()  # free the old one first (its layout goes with it)
            # Not pre-faulted when pageable: the first copy touches every page anyway.
            self.buffer, self.pinned_by = self.ops.alloc_host(max(layout.total_bytes, 1), self.pin)
            self.capacity = layout.total_bytes
        if layout != self.layout:
            self.views = {
                e.name: self.buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout.entries
            }
            # The alignment gaps are written and sent with the image: zero them (no stale heap bytes).
            ends = [e.offset + e.nbytes for e in layout.entries]
            for end, nxt in zip(ends, [e.offset for e in layout.entries[1:]] + [layout.total_bytes]):
                if nxt > end:
                    self.buffer[end:nxt].zero_()
            self.layout = layout

    def __del__(self) -> None:
        if self.pinned_by == "registered":  # an arena dropped without close(): unregister anyway
            try:
                self.ops.free_host(self.buffer, self.pinned_by)
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass

    def _free_buffer(self) -> None:
        buf, how = self.buffer, self.pinned_by
        self.views = {}
        self.layout = None
        self.buffer, self.pinned_by, self.capacity = torch.empty(0, dtype=torch.uint8), None, 0
        self.ops.free_host(buf, how)

    def fill(
        self, named: Sequence[tuple[str, torch.Tensor]], side_stream: Any = None, in_order: Collection[str] = ()
    ) -> None:
        """Copy the tensors in: CPU ones now, device ones queued (see the module docstring).
        `side_stream`: for large device tensors (default: the arena's). `in_order`: device
        tensors to copy on the current stream whatever their size (module buffers)."""
        ops = self.ops
        self.ready()  # a copy into this buffer still in flight must land before new ones
        if side_stream is None and self._side is not None:
            side_stream = self._side()
        side_device = ops.stream_device(side_stream) if side_stream is not None else None
        big: list[tuple[torch.Tensor, torch.Tensor]] = []
        in_stream_order: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        events: list[Any] = []
        sources: list[torch.Tensor] = []
        used: list[Any] = []  # streams given work, for the error path
        try:
            with torch.no_grad():
                for name, t in named:
                    dst = self.views[name]
                    if not ops.on_device(t):
                        dst.copy_(t)
                        continue
                    device = ops.device_of(t)
                    if (
                        side_stream is not None
                        and device == side_device
                        and name not in in_order
                        and t.numel() * t.element_size() >= _SMALL_TENSOR_BYTES
                    ):
                        big.append((dst, t))
                    else:
                        in_stream_order.setdefault(device, []).append((dst, t))
                # Small tensors: on the current stream of their device, in program order.
                for device, pairs in in_stream_order.items():
                    current = ops.current_stream(device)
                    used.append(current)
                    with ops.use(current):
                        for dst, t in pairs:
                            ops.copy(dst, t, non_blocking=self.pin)
                        ev = ops.new_event()
                        ev.record(current)
                    events.append(ev)
                    sources += [t for _, t in pairs]
                if side_stream is not None:
                    if big:  # after what is queued on the current stream (the optimizer step)
                        side_stream.wait_stream(ops.current_stream(side_device))
                        used.append(side_stream)
                        with ops.use(side_stream):
                            for dst, t in big:
                                ops.copy(dst, t, non_blocking=self.pin)
                        sources += [t for _, t in big]
                    # Recorded even with nothing queued: it also fences an earlier fill's copies.
                    ev = ops.new_event()
                    ev.record(side_stream)
                    events.append(ev)
                    self._fence_event, self._fence_device = ev, side_device
        except BaseException:
            for stream in used:  # nothing of a failed fill may still be in flight
                stream.synchronize()
            raise
        self._events = events
        self._sources = sources

    def fence(self) -> None:
        """Make the current stream wait for this slot's side-stream copies (on the GPU, no host stall)."""
        ev, device = self._fence_event, self._fence_device
        if ev is not None:
            self.ops.current_stream(device).wait_event(ev)

    def ready(self) -> None:
        """Block the calling (background) thread until the staged bytes are final."""
        events = self._events
        for ev in events:
            ev.synchronize()
        if events:
            self._events = []
            self._fence_event = None
            self._sources = []

    def in_flight(self) -> bool:
        """Whether copies of the last fill may still be running (True until ready() saw them done)."""
        return bool(self._events)

    def upload(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy this slot's views into the same-named `targets`, on each device's current stream; wait."""
        ops = self.ops
        streams: dict[Any, Any] = {}
        with torch.no_grad():
            for name, live in targets.items():
                src = self.views[name]
                if not ops.on_device(live):
                    live.copy_(src)
                    continue
                device = ops.device_of(live)
                stream = streams.setdefault(device, ops.current_stream(device))
                with ops.use(stream):
                    ops.copy(live, src, non_blocking=self.pin)
        for stream in streams.values():
            ev = ops.new_event()
            ev.record(stream)
            ev.synchronize()

    def image(self) -> torch.Tensor:
        """The whole staged layout as one uint8 tensor: every entry at its offset, zeroed gaps."""
        assert self.layout is not None
        return self.buffer[: self.layout.total_bytes]


class StagingArena:
    """A fixed number of reusable slots under a memory budget (`ops`: default ``DEVICE``)."""

    def __init__(
        self, slots: int = 2, budget_bytes: int | None = None, pin: bool | None = None, ops: DeviceOps | None = None
    ):
        if slots < 1:
            raise ValueError("the staging arena needs at least one slot")
        self.max_slots = slots
        self.layouts: dict[tuple, Layout] = {}  # the latest layout, so slots compare it by identity (Layout.of)
        self.budget_bytes = budget_bytes
        self.ops = ops if ops is not None else DEVICE
        self.pin = self.ops.available() if pin is None else pin
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        self._closed = False
        self._side_stream: Any = None

    def side_stream(self) -> Any:
        """The arena's stream for device-to-host copies (made on first use); None without a device."""
        if self._side_stream is None and self.ops.available():
            self._side_stream = self.ops.new_stream()
        return self._side_stream

    def _slots_for(self, layout: Layout) -> int:
        if self.budget_bytes is None:
            return self.max_slots
        fit = self.budget_bytes // max(layout.total_bytes, 1)
        if fit < 1:
            raise ConfigError(
                f"staging budget of {self.budget_bytes:,} bytes cannot hold one snapshot of "
                f"{layout.total_bytes:,} bytes; raise max_staging_bytes"  # (in bytes: "0 MiB" said nothing)
            )
        return min(self.max_slots, int(fit))

    def acquire(self, layout: Layout, wait: bool) -> Slot | None:
        """A free slot sized for `layout`, or None when all are busy and not `wait`ing."""
        n = self._slots_for(layout)
        dropped: list[Slot] = []
        slot: Slot | None
        with self._cond:
            while True:
                if self._closed:
                    raise FtkitError("the staging arena is closed")
                # Drop slots beyond the budget (only free ones), then add up to n.
                while len(self._slots) > n and not self._slots[-1].busy:
                    dropped.append(self._slots.pop())
                while len(self._slots) < n:
                    self._slots.append(Slot(self.pin, self.ops, self.side_stream))
                # Prefer a slot already big enough: no allocation on the hot path.
                free = [s for s in self._slots[:n] if not s.busy]
                trim: list[Slot] | None = []
                if free:
                    slot = max(free, key=lambda s: s.capacity >= layout.total_bytes)
                    trim = self._to_trim(slot, layout.total_bytes)
                    if trim is not None:
                        for s in (*trim, slot):
                            s.busy = True  # (the trimmed ones until their buffers are freed below)
                        break
                if not wait:
                    slot = None
                    break
                self._cond.wait()  # (every slot busy, or the busy ones leave no room under the budget)
        _free(dropped)  # (a slot's device error was raised when it was released)
        if slot is None:
            return None
        if trim:
            _free(trim)
            with self._cond:
                for s in trim:
                    s.busy = s is slot
                self._cond.notify_all()
        try:
            slot._ensure(layout)
        except Exception:
            self.release(slot)
            raise
        return slot

    def _to_trim(self, slot: Slot, need: int) -> list[Slot] | None:
        """The free slots whose buffers must go for `slot` to hold `need` bytes within the
        budget (`slot` too when its old buffer is bigger than that leaves room for), or None
        when the busy slots alone leave no room: sizes change between snapshots, and a
        slot's buffer only grows on its own. Called with the lock held."""
        if self.budget_bytes is None:
            return []
        busy = sum(s.capacity for s in self._slots if s.busy)
        if busy + need > self.budget_bytes:
            return None
        others = [s for s in self._slots if not s.busy and s is not slot and s.capacity]
        if busy + max(slot.capacity, need) + sum(s.capacity for s in others) <= self.budget_bytes:
            return []
        return [*others, slot] if busy + slot.capacity > self.budget_bytes else others

    def release(self, slot: Slot) -> None:
        try:
            slot.ready()  # a job that failed before reading the slot left its copies unwaited
        finally:
            with self._cond:
                slot.busy = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def borrow(self, layout: Layout) -> Iterator[Slot]:
        """A slot sized for `layout` for a block, never waiting: a free one of this arena's if it
        fits its budget (later snapshots reuse it), else a temporary one. For restore's scratch."""
        slot: Slot | None = None
        fits = self.budget_bytes is None or layout.total_bytes <= self.budget_bytes
        if not self._closed and fits:
            with contextlib.suppress(FtkitError):  # closed meanwhile
                slot = self.acquire(layout, wait=False)
        owned = slot is None
        if slot is None:
            slot = Slot(self.pin, self.ops)
            slot.busy = True
            slot._ensure(layout)
        try:
            yield slot
        finally:
            if owned:
                slot.ready()
                slot._free_buffer()
            else:
                self.release(slot)

    @contextlib.contextmanager
    def host_targets(self, targets: Mapping[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        """`targets` with each device tensor replaced by a view of a borrowed staging slot, for
        restore to read into; on a clean exit they are uploaded to the device tensors. The
        slot has room for the host tensors too, so the next snapshot reuses it."""
        device = {n: t for n, t in targets.items() if self.ops.on_device(t)}
        if not device:
            yield dict(targets)
            return
        host_bytes = sum(t.numel() * t.element_size() for n, t in targets.items() if n not in device)
        spare = torch.empty((), dtype=torch.uint8).expand(host_bytes + (1 << 20))  # no memory: a size
        layout = Layout.of([*device.items(), ("\0spare", spare)], self.layouts)
        with self.borrow(layout) as slot:
            yield {**targets, **{n: slot.views[n] for n in device}}
            slot.upload(device)

    @property
    def nbytes(self) -> int:
        return sum(s.capacity for s in self._slots)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            slots, self._slots = self._slots, []
            self._cond.notify_all()
        failed = _free(slots)
        if failed is not None:
            raise failed


def _free(slots: list[Slot]) -> Exception | None:
    """Free every slot's buffer once its copies are done; the first error of a slot's copies."""
    failed = None
    for s in slots:
        try:
            s.ready()
        except Exception as e:  # (a device error): the other slots' buffers are still freed
            failed = failed or e
        finally:
            s._free_buffer()
    return failed
