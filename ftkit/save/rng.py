"""This process's RNGs (Python's, torch's, numpy's, CUDA's) as state a snapshot carries
per rank: `rng_state()` at capture; at restore `rng_problems(decoded)` before the restore
vote, then `set_rng_state(decoded)` once every rank agreed."""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any

import torch


@functools.cache
def numpy_module():
    try:
        import numpy
    except ImportError:  # optional
        return None
    return numpy


def rng_state() -> dict[str, Any]:
    """Every RNG of this process (Python's 625 words as one tensor, not 625 skeleton values)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    np = numpy_module()
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_problems(state: Any) -> list[str]:
    """What keeps a decoded RNG state from being set: checked before the restore vote, so a
    malformed one fails its candidate instead of raising after the others have loaded."""
    if not isinstance(state, Mapping):
        return ["the RNG state is not a mapping"]
    out = []
    py = state.get("python")
    if py is not None:
        if isinstance(py, Mapping):
            internal, version = py.get("internal"), py.get("version")
            ok = (
                isinstance(internal, torch.Tensor)
                and internal.dtype == torch.int64
                and internal.shape == (625,)
                or isinstance(internal, (list, tuple))
                and len(internal) == 625
                and all(type(x) is int for x in internal)
            )
            if not ok or type(version) is not int or not isinstance(py.get("gauss"), (float, type(None))):
                out.append("Python's RNG state is malformed")
        elif not (isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], (list, tuple)) and len(py[1]) == 625):
            out.append("Python's RNG state is malformed")
    t = state.get("torch")
    if t is not None and not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        out.append("torch's RNG state is not a uint8 tensor")
    nps = state.get("numpy")
    if nps is not None:
        np = numpy_module()
        if not (
            isinstance(nps, tuple)
            and len(nps) == 5
            and nps[0] == "MT19937"
            and np is not None
            and isinstance(nps[1], np.ndarray)
            and nps[1].shape == (624,)
            and type(nps[2]) is int
        ):
            out.append("numpy's RNG state is malformed")
    cuda = state.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, (list, tuple)) and all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda)
    ):
        out.append("the CUDA RNG state is malformed")
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "python" in state:
        py = state["python"]  # a mapping, or the earlier form: (version, [625 ints], gauss)
        version, internal, gauss = (py["version"], py["internal"], py["gauss"]) if isinstance(py, Mapping) else py
        internal = internal.tolist() if isinstance(internal, torch.Tensor) else internal
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].clone())
    np = numpy_module()
    if np is not None and "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])[: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([s.clone() for s in saved])
