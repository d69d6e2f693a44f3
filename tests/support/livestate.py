"""A live training state and what a restore could change in it, for the tests that check that
nothing crafted reaches the live state: processes/test_live_state.py (and the fresh interpreters
it starts, with tests/support on their path) and unit/test_manifest_fuzz.py."""

from __future__ import annotations

import hashlib
import json

import torch

from ftkit.save import capture as cap


class Counter:
    """A user's object whose load_state_dict validates what it is given."""

    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, sd):
        if sd["count"] < 0:
            raise ValueError(f"count must be >= 0, not {sd['count']}")
        self.count = sd["count"]


def live_state(seed: int) -> dict:
    """A model and its optimizer after one step, a user object, a tensor and a plain value."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    state = {"model": model, "optim": opt, "counter": Counter(seed), "w": torch.randn(64), "epoch": seed}
    return {**state, "extra": None}


def fingerprint(state) -> tuple:
    """Everything a restore could change, byte for byte: which object each key maps to, the
    structure and plain values of every entry, every tensor's bytes, and the RNG state."""
    captured = cap.capture(state, rng=True)
    digest = hashlib.sha256(json.dumps([captured.skeleton, captured.rng], sort_keys=True).encode())
    for name, t in captured.tensors:
        digest.update(name.encode() + bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy()))
    return tuple((k, id(v)) for k, v in state.items()), digest.hexdigest()


def values(state) -> dict:
    """The state's tensors and plain values, cloned (what a restored step must equal)."""
    captured = cap.capture(state, rng=False)
    return {"skeleton": json.dumps(captured.skeleton), **{n: t.clone() for n, t in captured.tensors}}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] if isinstance(a[k], str) else torch.equal(a[k], b[k]) for k in a)
