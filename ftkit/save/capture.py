"""Turn live training state into tensors plus a JSON skeleton, and back: tensors get
path-like names (``model/fc.weight``) and ``{"$tensor": name}`` placeholders; what JSON
cannot express exactly is tagged (``$tuple``, ``$items``, ``$float``, ``$bytes``); anything
else is refused here, naming the key, because the only way to store it would be pickle."""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Mapping, MutableMapping, MutableSequence
from dataclasses import dataclass
from typing import Any

import torch

from ftkit.errors import CaptureError, StateMismatchError, one_line
from ftkit.format.skeleton_values import TAGS
from ftkit.save.rng import numpy_module, rng_state, set_rng_state

RNG_KEY = "_rng"
_MARKER_SET = frozenset(TAGS)
_AS_IS = frozenset((int, str, bool, type(None)))  # exact types whose JSON is the value itself


@dataclass
class CapturedState:
    skeleton: dict[str, Any]  # {"entries": {name: {"kind": ..., "value": ...}}}: the shared entries
    tensors: list[tuple[str, torch.Tensor]]  # (name, live tensor), in capture order
    rng: Any = None  # this process's encoded RNG state, when captured
    local: dict[str, Any] | None = None  # the RankLocal entries, encoded like the skeleton's

    @property
    def rank_state(self) -> dict[str, Any]:
        """What this rank saves of its own (a manifest's ``rank_state["<rank>"]``)."""
        return {"rng": self.rng, "local": self.local} if self.local else {"rng": self.rng}


class RankLocal:
    """A state entry whose value differs per rank: saved for each rank, restored to the same rank.

    Everything else in a Checkpointer's state is taken to be the same on every rank and
    saved once. Wrap what is not (a rank's data iterator position, a per-rank counter)::

        state = {"model": model, "loader": ftkit.RankLocal(my_stateful_loader)}

    `value` is an object with ``state_dict()``/``load_state_dict()``, or a mutable mapping
    whose items are replaced on restore. A rank the checkpoint has no state for (the world
    grew) keeps its live value, and this is logged.
    """

    def __init__(self, value: Any):
        if not _is_stateful(value) and not isinstance(value, MutableMapping):
            raise TypeError(
                f"RankLocal wraps an object with state_dict()/load_state_dict() or a mutable mapping, "
                f"not a {type(value).__name__}"
            )
        self.value = value

    def state_dict(self) -> Any:
        return self.value.state_dict() if _is_stateful(self.value) else dict(self.value)

    def load_state_dict(self, state: Any) -> None:
        if _is_stateful(self.value):
            self.value.load_state_dict(state)
        else:
            self.value.clear()
            self.value.update(state)


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._names: set[str] = set()

    def _add_tensor(self, path: str, t: torch.Tensor) -> str:
        name, n = path, 1
        while name in self._names:  # two containers flattening to one path
            n += 1
            name = f"{path}#{n}"
        self._names.add(name)
        self.tensors.append((name, t))
        return name

    def _object(self, value: Mapping, path: str) -> dict[str, Any]:
        """A mapping with plain keys as a JSON object (exact ints, strings, bools and None as is)."""
        return {k: v if type(v) in _AS_IS else self.encode(v, f"{path}/{k}") for k, v in value.items()}

    def encode(self, value: Any, path: str) -> Any:
        # Once per value of the state at every snapshot, on the training thread: commonest kinds first.
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._add_tensor(path, _check_tensor(value, path))}
        if isinstance(value, dict) and _plain_keys(value):
            return self._object(value, path)
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}  # 'inf', '-inf', 'nan'
        if isinstance(value, tuple):  # torch.Size and namedtuples come back as plain tuples
            return {"$tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [v if type(v) in _AS_IS else self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, (bytes, bytearray)):  # e.g. a data loader's own serialized state
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, Mapping):
            if not isinstance(value, dict) and _plain_keys(value):  # a dict's were checked above
                return self._object(value, path)
            items = []
            for k, v in value.items():
                if isinstance(k, (torch.Tensor, list, dict)):
                    raise CaptureError(f"cannot store {path!r}: dict key of type {type(k).__name__}")
                items.append([self.encode(k, f"{path}/<key>"), self.encode(v, f"{path}/{k}")])
            return {"$items": items}
        np = numpy_module()
        if np is not None:
            if isinstance(value, np.ndarray):
                if value.dtype == object:
                    raise CaptureError(f"cannot store {path!r}: a numpy array of Python objects needs pickle")
                if not value.dtype.isnative:  # big-endian: the same values in this machine's order
                    value = value.astype(value.dtype.newbyteorder("="))
                try:
                    t = torch.from_numpy(value.copy())
                except (TypeError, ValueError):  # strings, datetimes...: no tensor dtype holds them
                    raise CaptureError(f"cannot store {path!r}: torch has no dtype for numpy {value.dtype}") from None
                return {"$ndarray": self._add_tensor(path, t)}
            if isinstance(value, np.generic):
                return self.encode(value.item(), path)
        if isinstance(value, torch.dtype):
            raise CaptureError(f"cannot store {path!r}: a torch.dtype value would need pickle")
        kind = "a function" if callable(value) else f"a {type(value).__module__}.{type(value).__qualname__}"
        raise CaptureError(
            f"cannot store {path!r} ({kind}) without pickle; store tensors, numbers, strings, lists or dicts there"
        )


def _plain_keys(mapping: Mapping) -> bool:
    """Whether a dict can be stored as a JSON object as is (string keys, none a tag)."""
    for k in mapping:  # a loop is cheaper than all(...) over a generator, on the hot path
        if not isinstance(k, str):
            return False
    return _MARKER_SET.isdisjoint(mapping)


def _check_tensor(t: torch.Tensor, path: str) -> torch.Tensor:
    if t.layout != torch.strided:
        raise CaptureError(f"cannot store {path!r}: {t.layout} tensors are not supported; densify them first")
    if t.dtype not in _storable_dtypes():
        if t.is_quantized:
            raise CaptureError(f"cannot store {path!r}: quantized tensors are not supported")
        raise CaptureError(f"cannot store {path!r}: dtype {t.dtype} is not supported")
    return t.detach() if t.requires_grad else t  # a parameter itself; detach only when needed


@functools.cache
def _storable_dtypes() -> frozenset:
    """The torch dtypes the format has names for."""
    from ftkit.format.manifest import DTYPES

    return frozenset(getattr(torch, n) for n in DTYPES if hasattr(torch, n))


def capture(state: Mapping[str, Any], *, rng: bool = True, rng_path: str = f"{RNG_KEY}/r0") -> CapturedState:
    """Walk `state` (and the RNGs when `rng`) into tensors plus a JSON skeleton. RNG and
    RankLocal tensors are named below `rng_path`, which callers make rank-specific."""
    enc = _Encoder()
    entries: dict[str, Any] = {}
    local: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key or key == RNG_KEY or "/" in key:
            raise CaptureError(f"state key {key!r} must be a non-empty string without '/' (and not {RNG_KEY!r})")
        if isinstance(obj, RankLocal):
            local[key] = {"kind": "stateful", "value": enc.encode(obj.state_dict(), f"{rng_path}/local/{key}")}
        else:
            kind = entry_kind(obj)
            entries[key] = {"kind": kind, "value": enc.encode(obj.state_dict() if kind == "stateful" else obj, key)}
    rng_value = enc.encode(rng_state(), rng_path) if rng else None
    return CapturedState({"entries": entries}, enc.tensors, rng_value, local or None)


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild a Python value from its skeleton form, taking tensors by name."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tensor":
            return tensors[inner]
        if tag == "$ndarray":
            return tensors[inner].numpy()
        if tag == "$tuple":
            return tuple(decode(v, tensors) for v in inner)
        if tag == "$items":
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in inner}
        if tag == "$float":
            return float(inner)
        if tag == "$bytes":
            return base64.b64decode(inner)
    return {k: decode(v, tensors) for k, v in value.items()}


def tensor_refs(value: Any) -> set[str]:
    """The names of the tensors a skeleton value refers to ($tensor and $ndarray tags)."""
    out: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack += v
        elif isinstance(v, dict):
            if len(v) == 1:
                ((tag, inner),) = v.items()
                if tag in ("$tensor", "$ndarray") and isinstance(inner, str):
                    out.add(inner)
                    continue
            stack += v.values()
    return out


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def entry_kind(live: Any) -> str:
    """The kind of skeleton entry a live state value is saved as (what capture writes)."""
    if isinstance(live, torch.Tensor):
        return "tensor"
    return "stateful" if _is_stateful(live) else "value"


_KIND_WORDS = {"stateful": "an object's state_dict", "tensor": "a tensor", "value": "a plain value"}


def check(
    state: Mapping[str, Any],
    skeleton: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, Any] | None = None,
) -> list[str]:
    """What keeps the checkpoint from loading into the live `state` (empty: it fits): every
    saved entry must have the live entry's kind and structure (`_compare`). `local`: this
    rank's saved RankLocal entries. `tensors` may be stand-ins of the saved shapes and dtypes."""
    entries = skeleton["entries"]
    problems: list[str] = []
    missing = [k for k in state if k not in entries and not isinstance(state[k], RankLocal)]
    if missing:
        problems.append(f"not in checkpoint: {', '.join(missing)}")
    for key, entry in entries.items():
        if key not in state or isinstance(state[key], RankLocal):
            problems.append(f"{key}: in checkpoint but not in the live state")
            continue
        live = state[key]
        kind = entry_kind(live)
        if entry["kind"] != kind:
            problems.append(
                f"{key}: checkpoint holds {_KIND_WORDS.get(entry['kind'], entry['kind'])}, live value is {_what(live)}"
            )
            continue
        saved = decode(entry["value"], tensors)
        if kind == "stateful":
            problems += _compare(live.state_dict(), saved, key, strict_keys=isinstance(live, torch.nn.Module))
        elif kind == "tensor" and not isinstance(saved, torch.Tensor):
            problems.append(f"{key}: checkpoint holds {_what(saved)} for a tensor")
        else:
            problems += _compare(live, saved, key, strict_keys=kind == "tensor")
    for key, entry in (local or {}).items():
        obj = state.get(key)
        if isinstance(obj, RankLocal):
            problems += _compare(obj.state_dict(), decode(entry["value"], tensors), key, strict_keys=False)
    return problems


def describe(problems: list[str]) -> str:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    return f"checkpoint does not fit the live state: {shown}"


def load(
    state: MutableMapping[str, Any],
    skeleton: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    rng_value: Any = None,
    local_value: Mapping[str, Any] | None = None,
) -> None:
    """Load decoded values into the live `state` in place (after `check`), then RankLocal and RNG state."""
    for key, entry in skeleton["entries"].items():
        value = decode(entry["value"], tensors)
        if entry["kind"] == "stateful":
            try:
                state[key].load_state_dict(value)
            except Exception as e:  # a user object's own validation; keep its words
                raise StateMismatchError(f"{key}: load_state_dict refused the checkpoint: {one_line(e, 300)}") from e
        elif entry["kind"] == "tensor":
            with torch.no_grad():
                state[key].copy_(value)
        elif not refill(state.get(key), value):
            state[key] = value
    for key, obj in state.items():
        if isinstance(obj, RankLocal) and local_value is not None and key in local_value:
            try:
                obj.load_state_dict(decode(local_value[key]["value"], tensors))
            except Exception as e:  # a user object's own validation; keep its words
                raise StateMismatchError(f"{key}: load_state_dict refused this rank's state: {one_line(e, 300)}") from e
    if rng_value is not None:
        set_rng_state(decode(rng_value, tensors))


def refill(live: Any, value: Any) -> bool:
    """Put a decoded plain value into the live mutable mapping or list it was saved from, in
    place: the training loop may hold that object (and a defaultdict stays one). False when
    `live` is no such container, or `value` not of its kind: the caller assigns it instead."""
    if isinstance(live, MutableMapping) and isinstance(value, Mapping):
        live.clear()
        live.update(value)
    elif isinstance(live, MutableSequence) and isinstance(value, list):
        live[:] = value
    else:
        return False
    return True


def apply(state: MutableMapping[str, Any], skeleton: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """check() then load(): a mismatch raises before anything in `state` changes."""
    problems = check(state, skeleton, tensors)
    if problems:
        raise StateMismatchError(describe(problems))
    load(state, skeleton, tensors)


def _compare(live: Any, saved: Any, path: str, *, strict_keys: bool) -> list[str]:
    """Kind, structure, shape, dtype and key differences between a live value and a decoded
    saved one. None on either side matches anything (an empty momentum buffer); a number
    matches a 0-dim tensor (an optimizer's step count, across torch releases); keys only
    one side has are not compared unless `strict_keys` (a module's)."""
    if live is None or saved is None:
        return []
    kind, saved_kind = _kind(live), _kind(saved)
    if kind != saved_kind or (kind is None and _is_stateful(live)):
        tensor, other = (live, saved) if kind == "tensor" else (saved, live)
        if "tensor" in (kind, saved_kind) and tensor.dim() == 0 and _is_number(other):
            return []
        return [f"{path}: checkpoint holds {_what(saved)}, live value is {_what(live)}"]
    if kind == "tensor":
        if tuple(live.shape) != tuple(saved.shape):
            return [f"{path}: shape {tuple(saved.shape)} in checkpoint, {tuple(live.shape)} live"]
        if live.dtype != saved.dtype:
            return [f"{path}: dtype {saved.dtype} in checkpoint, {live.dtype} live"]
        return []
    out = []
    if kind == "mapping":
        if strict_keys:
            extra = [str(k) for k in saved if k not in live]
            lost = [str(k) for k in live if k not in saved]
            if extra:
                out.append(f"{path}: unexpected keys in checkpoint: {', '.join(extra[:5])}")
            if lost:
                out.append(f"{path}: keys missing from checkpoint: {', '.join(lost[:5])}")
        for k in saved:
            if k in live:
                out += _compare(live[k], saved[k], f"{path}/{k}", strict_keys=strict_keys)
    elif kind == "sequence":
        for i, (a, b) in enumerate(zip(live, saved)):
            out += _compare(a, b, f"{path}/{i}", strict_keys=strict_keys)
    return out  # two numpy arrays, or plain values of any type (which replace each other): nothing


def _kind(v: Any) -> str | None:
    """What `_compare` compares a value as (None: a plain value)."""
    if isinstance(v, torch.Tensor):
        return "tensor"
    if _is_ndarray(v):
        return "ndarray"
    if isinstance(v, Mapping):
        return "mapping"
    return "sequence" if isinstance(v, (list, tuple)) else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_ndarray(v: Any) -> bool:
    np = numpy_module()
    return np is not None and isinstance(v, np.ndarray)


def _what(v: Any) -> str:
    """A value's kind in words, for a mismatch message."""
    if isinstance(v, torch.Tensor):
        return f"a tensor {tuple(v.shape)}"
    if _is_stateful(v):
        return f"an object with state_dict ({type(v).__name__})"
    if isinstance(v, Mapping):
        return "a mapping"
    if isinstance(v, (list, tuple)):
        return f"a {'list' if isinstance(v, list) else 'tuple'} of {len(v)}"
    if _is_ndarray(v):
        return "a numpy array"
    return f"the plain value {type(v).__name__} {str(v)[:20]!r}" if v is not None else "None"


def module_buffer_names(state: Mapping[str, Any]) -> frozenset[str]:
    """The captured names of every module buffer in `state` (for `Slot.fill(in_order=)`)."""
    return frozenset(
        f"{key}/{name}"
        for key, obj in state.items()
        if isinstance(obj, torch.nn.Module)
        for name, _ in obj.named_buffers()
    )
