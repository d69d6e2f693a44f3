"""Every CUDA call the staging path makes, behind one interface: an arena takes them from
``ftkit.save.staging.DEVICE``, so tests without a GPU drive the same logic with a simulated
device (tests/support/fakedevice.py)."""

from __future__ import annotations

from typing import Any

import torch


class DeviceOps:
    def available(self) -> bool:
        return torch.cuda.is_available()

    def on_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def device_of(self, t: torch.Tensor) -> Any:
        return t.device

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def stream_device(self, stream: Any) -> Any:
        return stream.device

    def current_stream(self, device: Any) -> Any:
        return torch.cuda.current_stream(device)

    def use(self, stream: Any) -> Any:
        """A context in which `stream` is the current stream (copies are queued on it)."""
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event(blocking=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def alloc_host(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, str | None]:
        """A host buffer of exactly `nbytes`, page-locked when `pin`; and how it was pinned."""
        if not pin:
            return torch.empty(nbytes, dtype=torch.uint8), None
        buf = torch.empty(nbytes, dtype=torch.uint8)
        try:
            buf.zero_()  # fault the pages in (in parallel) before locking them
            torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1)  # 1: portable (every context)
            if buf.is_pinned():
                return buf, "registered"
        except Exception:  # noqa: BLE001 (any failure: the pinned allocator instead)
            pass
        del buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "allocator"

    def free_host(self, buf: torch.Tensor, how: str | None) -> None:
        """Undo alloc_host's registration; the caller then drops its references."""
        if how == "registered" and buf.numel():
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
