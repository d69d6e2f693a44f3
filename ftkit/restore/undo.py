"""The live state as it was before a restore touched it: what a failed restore puts back.

A restore reads straight into the live tensors and then loads the objects; either can
fail half-way, on some ranks only. So before the first write it takes an UndoCopy: the
state's structure and objects by reference, and every live tensor's bytes copied into a
staging slot of the arena (reused memory, not an allocation per restore).

Order of calls (restore/__init__.py)::

    with UndoCopy.take(state, rng=..., rank=..., arena=...) as undo:   # before any write
        ... a candidate fails its read or vote ...   undo.put_back_bytes()
        ... a load fails on some rank ...            undo.roll_back()
        ... a step loaded on every rank ...          undo.keep()
    # leaving the block without keep() (an error, every candidate failed): roll_back()
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch

from ftkit.errors import FtkitError, one_line
from ftkit.save import capture as cap
from ftkit.save.layout import Layout
from ftkit.save.rng import set_rng_state
from ftkit.save.sharding import is_dtensor

log = logging.getLogger("ftkit")


class UndoCopy:
    """What a restore may change in the live state, as it was."""

    def __init__(self, state: MutableMapping[str, Any], captured: cap.CapturedState, slot: Any):
        self.state = state
        self.captured = captured
        self.objects = dict(state)  # key -> the object itself: a failed load may have replaced a value
        self.tensors = dict(captured.tensors)  # name -> live tensor (DTensors as they are)
        self.targets = {n: _local(t) for n, t in captured.tensors}  # where the bytes go back
        self.slot = slot
        self.kept = False

    @staticmethod
    @contextmanager
    def take(state: MutableMapping[str, Any], *, rng: bool, rank: int, arena: Any) -> Iterator[UndoCopy]:
        """Copy the live state aside for the length of the block; put it back on leaving
        unless keep() was called. `arena`: the StagingArena the bytes go to."""
        captured = cap.capture(state, rng=rng, rng_path=f"{cap.RNG_KEY}/r{rank}")
        named = [(n, _local(t)) for n, t in captured.tensors]
        with arena.borrow(Layout.of(named, arena.layouts)) as slot:
            slot.fill(named)
            slot.ready()
            undo = UndoCopy(state, captured, slot)
            try:
                yield undo
            finally:
                if not undo.kept:
                    undo.roll_back()

    def keep(self) -> None:
        """The restore succeeded: leaving the block changes nothing."""
        self.kept = True

    def put_back_bytes(self) -> None:
        """Every live tensor's bytes as they were (after a candidate that failed before any load)."""
        self.slot.upload(self.targets)

    def roll_back(self) -> None:
        """The whole live state as it was: bytes, objects, their state_dicts, the contents of plain
        containers, RankLocal entries and the RNG state. Raises FtkitError if an object refuses
        its own state back."""
        self.put_back_bytes()
        try:
            for key, obj in self.objects.items():
                if self.state.get(key) is not obj:
                    self.state[key] = obj
            for key, entry in self.captured.skeleton["entries"].items():
                if entry["kind"] == "stateful":
                    self.objects[key].load_state_dict(cap.decode(entry["value"], self.tensors))
                elif entry["kind"] == "value":  # a container the load refilled in place: its contents back
                    cap.refill(self.objects[key], cap.decode(entry["value"], self.tensors))
            for key, entry in (self.captured.local or {}).items():
                self.objects[key].load_state_dict(cap.decode(entry["value"], self.tensors))
            if self.captured.rng is not None:
                set_rng_state(cap.decode(self.captured.rng, self.tensors))
        except Exception as e:
            raise FtkitError(
                f"a failed restore could not put the live state back as it was ({one_line(e)}); do not train on it"
            ) from e


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t
