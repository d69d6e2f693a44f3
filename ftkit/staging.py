"""The staging arena: reused host buffers the training state is copied into.

Copying into fresh memory is ~10x slower than into reused memory (first-touch
page faults), so the arena allocates each slot once and reuses it for every
snapshot of the same size (or smaller). Two slots give double buffering: one can be
filled while the other is still being persisted. A memory budget caps the total;
when it only fits one slot, snapshots serialize on it.

Order of calls::

    layout = Layout.of(named_tensors)         # pure plan: offsets in one flat buffer
    slot = arena.acquire(layout, wait=...)    # None when busy and not waiting
    slot.fill(named_tensors)                  # the training stall (CPU); async on CUDA
    ...background: slot.ready() ... read slot.views / slot.buffer ...
    arena.release(slot)

On CUDA the slot is pinned and :meth:`Slot.fill` issues device-to-host copies on a
side stream and records an event; :meth:`Slot.fence` makes the current stream wait
for that event (the optimizer step pre-hook calls it), so the copy overlaps forward
and backward and nothing modifies a tensor before it is staged. Small tensors
(BatchNorm buffers and the like, which forward mutates in place) are copied on the
current stream, in order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import FtkitError

ALIGN = 64
_SMALL_TENSOR_BYTES = 1 << 20


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # into the flat staging buffer
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a snapshot lives in one flat byte buffer."""

    entries: tuple[TensorSlot, ...]
    total_bytes: int

    @staticmethod
    def of(named: Sequence[tuple[str, torch.Tensor]]) -> "Layout":
        entries, offset = [], 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            entries.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return Layout(tuple(entries), offset)


class Slot:
    """One staging buffer and what is staged in it."""

    def __init__(self, index: int, pin: bool):
        self.index = index
        self.pin = pin
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.layout: Layout | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.busy = False
        self._event = None  # CUDA event of the last side-stream copy
        self._sources: list[torch.Tensor] = []  # kept alive until the copy is done
        # What the owner attaches to a filled slot (step, skeleton, ...).
        self.meta: dict = {}

    def _ensure(self, layout: Layout) -> bool:
        """Size the buffer for `layout`; True when it had to (re)allocate."""
        grew = False
        if layout.total_bytes > self.capacity:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            # Not pre-faulted: the first copy touches every page anyway (a separate
            # zero-fill would be a second pass); every later copy reuses them.
            self.buffer = torch.empty(max(layout.total_bytes, 1), dtype=torch.uint8, pin_memory=self.pin)
            self.capacity = layout.total_bytes
            grew = True
        if grew or layout != self.layout:
            self.views = {
                e.name: self.buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
                for e in layout.entries
            }
            # The alignment gaps are part of the slot's byte image (written and sent as
            # is): zero them, so no stale heap bytes leave the process.
            ends = [e.offset + e.nbytes for e in layout.entries]
            for end, nxt in zip(ends, [e.offset for e in layout.entries[1:]] + [layout.total_bytes]):
                if nxt > end:
                    self.buffer[end:nxt].zero_()
            self.layout = layout
        return grew

    def fill(self, named: Sequence[tuple[str, torch.Tensor]], side_stream=None) -> None:
        """Copy the tensors in. Synchronous for CPU tensors; CUDA ones go on `side_stream`."""
        cuda_big = []
        with torch.no_grad():
            for name, t in named:
                dst = self.views[name]
                if t.is_cuda and side_stream is not None and t.numel() * t.element_size() >= _SMALL_TENSOR_BYTES:
                    cuda_big.append((dst, t))
                else:
                    dst.copy_(t)
            if cuda_big:
                side_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side_stream):
                    for dst, t in cuda_big:
                        dst.copy_(t, non_blocking=True)
                    self._event = torch.cuda.Event()
                    self._event.record(side_stream)
                self._sources = [t for _, t in cuda_big]
            elif any(t.is_cuda for _, t in named):
                torch.cuda.current_stream().synchronize()

    def fence(self) -> None:
        """Make the current CUDA stream wait for this slot's copies (no host stall)."""
        ev = self._event
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def ready(self) -> None:
        """Block the calling (background) thread until the staged bytes are final."""
        ev = self._event
        if ev is not None:
            ev.synchronize()
            self._event = None
            self._sources = []

    def raw(self, name: str) -> memoryview:
        """The staged bytes of one tensor."""
        e = next(x for x in self.layout.entries if x.name == name)  # type: ignore[union-attr]
        return self.bytes_of(e)

    def bytes_of(self, e: TensorSlot) -> memoryview:
        """The staged bytes of one entry of the layout."""
        return _bytes_view(self.buffer[e.offset:e.offset + e.nbytes])

    def image(self) -> torch.Tensor:
        """The whole staged layout as one uint8 tensor: every entry at its offset, zeroed gaps."""
        assert self.layout is not None
        return self.buffer[:self.layout.total_bytes]


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


class StagingArena:
    """A fixed number of reusable slots under a memory budget."""

    def __init__(self, slots: int = 2, budget_bytes: int | None = None, pin: bool | None = None):
        if slots < 1:
            raise ValueError("the staging arena needs at least one slot")
        self.max_slots = slots
        self.budget_bytes = budget_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._slots: list[Slot] = []
        self._cond = threading.Condition()
        self._closed = False

    def _slots_for(self, layout: Layout) -> int:
        if self.budget_bytes is None:
            return self.max_slots
        fit = self.budget_bytes // max(layout.total_bytes, 1)
        if fit < 1:
            raise FtkitError(
                f"staging budget of {self.budget_bytes / 2**20:.0f} MiB cannot hold one snapshot of "
                f"{layout.total_bytes / 2**20:.0f} MiB; raise max_staging_bytes"
            )
        return min(self.max_slots, int(fit))

    def acquire(self, layout: Layout, wait: bool, timeout: float | None = None) -> Slot | None:
        """A free slot sized for `layout`, or None when all are busy and not `wait`ing."""
        n = self._slots_for(layout)
        with self._cond:
            while True:
                if self._closed:
                    raise FtkitError("the staging arena is closed")
                # Drop slots beyond the budget (only free ones), then add up to n.
                while len(self._slots) > n and not self._slots[-1].busy:
                    self._slots.pop()
                while len(self._slots) < n:
                    self._slots.append(Slot(len(self._slots), self.pin))
                # Prefer a slot already big enough: no allocation on the hot path.
                free = [s for s in self._slots[:n] if not s.busy]
                if free:
                    slot = max(free, key=lambda s: s.capacity >= layout.total_bytes)
                    slot.busy = True
                    break
                if not wait:
                    return None
                if not self._cond.wait(timeout):
                    return None
        try:
            slot._ensure(layout)
        except Exception:
            self.release(slot)
            raise
        return slot

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.busy = False
            slot.meta = {}
            self._cond.notify_all()

    @property
    def nbytes(self) -> int:
        return sum(s.capacity for s in self._slots)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for s in self._slots:
                s.buffer = torch.empty(0, dtype=torch.uint8)
                s.views = {}
                s.capacity = 0
            self._slots = []
            self._cond.notify_all()
