"""Where each tensor of a snapshot lives in one flat staging buffer: a pure plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64  # every tensor starts at a multiple of this in the buffer (and in an uncompressed data file)


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # into the flat staging buffer
    nbytes: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[TensorSlot, ...]
    total_bytes: int

    @staticmethod
    def of(named: Sequence[tuple[str, torch.Tensor]], memo: dict[tuple, Layout] | None = None) -> Layout:
        """The layout of `named`; with `memo` (its owner's), the same object as last time when the
        names, shapes and dtypes are: a slot then compares layouts by identity."""
        key = tuple((name, t.shape, t.dtype) for name, t in named) if memo is not None else ()
        cached = memo.get(key) if memo is not None else None
        if cached is not None:
            return cached
        entries, offset = [], 0
        for name, t in named:
            nbytes = t.numel() * t.element_size()
            entries.append(TensorSlot(name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        layout = Layout(tuple(entries), offset)
        if memo is not None:
            memo.clear()  # one state per owner: keep only the latest layout
            memo[key] = layout
        return layout
