"""A simulated GPU for driving ftkit's CUDA staging path on machines without one.

`FakeDevice` has the methods of `ftkit.save.device.DeviceOps`. Its "device tensors"
are ordinary CPU tensors the test declared resident (`put`); its streams are FIFO
queues of operations (copies, kernels the test `launch`es, waits on events)
that run only when the scheduling policy lets them or when the host waits:

* ``"current_first"``: the current (default) stream of each device runs every
  operation as soon as it is queued (pulling in whatever it waits for); other
  streams run only when something waits for them. Host code that writes
  tensors directly (a real optimizer step, a forward pass) behaves like work on
  the current stream. The adversary for missing fences: a write right after the
  snapshot runs before any side-stream copy unless the current stream was made
  to wait for it.
* ``"side_first"``: streams other than the default run as soon as work is
  queued; the default streams run only when waited for. Training writes must be
  queued with `launch` here. The adversary for a side stream that does not wait
  for work already queued on the current stream.
* ``"lazy"``: nothing runs until the host waits. The adversary for a host that
  reads staged bytes without waiting for the copy.

Every queued copy is logged (`copies`) with the stream it went on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftkit.save.device import DeviceOps

POLICIES = ("current_first", "side_first", "lazy")


@dataclass
class CopyRecord:
    stream: str
    nbytes: int
    non_blocking: bool
    kind: str  # "d2h", "h2d" or "h2h"


class FakeEvent:
    def __init__(self, dev: FakeDevice):
        self.dev = dev
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream | None = None) -> None:
        with self.dev.lock:
            stream = stream if stream is not None else self.dev.current_stream("fake:0")
            self.stream, self.position = stream, len(stream.queue)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        if threading.current_thread() is not self.dev.main_thread:
            # The host thread that waits here is the persist thread: held until the test lets it.
            if not self.dev.background_gate.wait(timeout=30):
                raise TimeoutError("the test never released the background thread")
        if self.stream is not None:
            self.dev.run(self.stream, self.position)


@dataclass(eq=False)
class FakeStream:
    dev: FakeDevice
    name: str
    device: str
    queue: list = field(default_factory=list)  # ("op", fn) or ("wait", FakeEvent)
    done: int = 0

    def enqueue(self, item: tuple) -> None:
        with self.dev.lock:
            self.queue.append(item)
            if self.dev.eager(self):
                self.dev.run(self, len(self.queue))

    def wait_event(self, ev: FakeEvent) -> None:
        self.enqueue(("wait", ev))

    def wait_stream(self, other: FakeStream) -> None:
        ev = FakeEvent(self.dev)
        ev.record(other)
        self.wait_event(ev)

    def synchronize(self) -> None:
        self.dev.run(self, len(self.queue))

    def pending(self) -> int:
        return len(self.queue) - self.done


class FakeDevice(DeviceOps):
    def __init__(self, policy: str = "current_first", hold_background: bool = False):
        assert policy in POLICIES, policy
        self.policy = policy
        self.main_thread = threading.current_thread()
        # Waits on events from other threads (ftkit's persist thread) block until this is set.
        self.background_gate = threading.Event()
        if not hold_background:
            self.background_gate.set()
        self._others: list[FakeStream] = []
        self.lock = threading.RLock()
        self._defaults: dict[str, FakeStream] = {}
        self._local = threading.local()
        self._resident: dict[int, str] = {}  # storage data_ptr -> device name
        self.copies: list[CopyRecord] = []
        self.streams_made = 0
        self.allocs: list[int] = []  # nbytes of each host buffer handed out
        self.frees = 0
        self.freed_sources = 0  # copies that ran after their source tensor was freed

    # ------------------------------------------------------------ the device
    def put(self, *objs: Any, device: str = "fake:0") -> None:
        """Declare tensors (and the parameters, buffers and optimizer state of objects) resident."""
        for obj in objs:
            for t in _tensors_of(obj):
                self._resident[t.untyped_storage().data_ptr()] = device

    def eager(self, stream: FakeStream) -> bool:
        is_default = self._defaults.get(stream.device) is stream
        return (self.policy == "current_first" and is_default) or (self.policy == "side_first" and not is_default)

    def run(self, stream: FakeStream, upto: int) -> None:
        """Run `stream`'s queued work up to position `upto`, and what it waits for."""
        with self.lock:
            while stream.done < upto:
                kind, payload = stream.queue[stream.done]
                if kind == "wait":
                    if payload.stream is not None:
                        self.run(payload.stream, payload.position)
                else:
                    payload()
                stream.queue[stream.done] = (kind, None)  # drop the closure: no hidden keep-alive
                stream.done += 1

    def drain(self) -> None:
        """Let every stream finish (time passes)."""
        with self.lock:
            for s in list(self._defaults.values()) + self._others:
                s.synchronize()

    def launch(self, fn: Callable[[], Any], device: str = "fake:0") -> None:
        """Queue `fn` (a "kernel": it reads and writes resident tensors) on the current stream."""
        self.current_stream(device).enqueue(("op", fn))

    def default_stream(self, device: str = "fake:0") -> FakeStream:
        with self.lock:
            if device not in self._defaults:
                self._defaults[device] = FakeStream(self, f"default@{device}", device)
            return self._defaults[device]

    # ------------------------------------------------------------ DeviceOps
    def available(self) -> bool:
        return True

    def on_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._resident

    def device_of(self, t: torch.Tensor) -> str:
        return self._resident[t.untyped_storage().data_ptr()]

    def new_stream(self, device: str = "fake:0") -> FakeStream:
        with self.lock:
            self.streams_made += 1
            s = FakeStream(self, f"side{self.streams_made}@{device}", device)
            self._others.append(s)
            return s

    def stream_device(self, stream: FakeStream) -> str:
        return stream.device

    def current_stream(self, device: Any = "fake:0") -> FakeStream:
        over = getattr(self._local, "over", {})
        return over.get(device) or self.default_stream(device)

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        over = self._local.__dict__.setdefault("over", {})
        before = over.get(stream.device)
        over[stream.device] = stream
        try:
            yield
        finally:
            if before is None:
                del over[stream.device]
            else:
                over[stream.device] = before

    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        d_src, d_dst = self.on_device(src), self.on_device(dst)
        device = self.device_of(src) if d_src else self.device_of(dst) if d_dst else "fake:0"
        stream = self.current_stream(device)
        kind = "d2h" if d_src and not d_dst else "h2d" if d_dst and not d_src else "h2h"
        self.copies.append(CopyRecord(stream.name, src.numel() * src.element_size(), non_blocking, kind))

        # A queued copy holds no reference to its source, as a GPU holds none: whoever queued it
        # must keep the tensor alive until the copy ran (else its memory is reused: garbage).
        src_ref = weakref.ref(src)

        def op(dst=dst) -> None:
            live = src_ref()
            if live is None:
                self.freed_sources += 1
                dst.view(-1).view(torch.uint8).fill_(0x5A)
            else:
                dst.copy_(live)

        stream.enqueue(("op", op))
        del src
        if not non_blocking:
            stream.synchronize()

    def alloc_host(self, nbytes: int, pin: bool):
        self.allocs.append(nbytes)
        # Never-written memory holds leftovers: a fixed pattern, so reading it unwaited shows.
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8), ("fake-pinned" if pin else None)

    def free_host(self, buf: torch.Tensor, how: str | None) -> None:
        if buf.numel():
            self.frees += 1


def _tensors_of(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for st in obj.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # Adam's scalar 'step' stays on the host
                    yield v
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_of(o)
