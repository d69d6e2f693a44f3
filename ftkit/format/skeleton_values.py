"""The skeleton's values (a manifest's, a rank's state's): JSON whose tags are well formed and
name only tensors the document lists for them (validate.py checks the rest)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ftkit.errors import FormatError

MAX_DEPTH = 200  # skeleton nesting; JSON parsers give up near 1000
TAGS = ("$tensor", "$ndarray", "$tuple", "$items", "$float", "$bytes")


def check_rank_state(state: dict[str, Any], own: set[str], where: str, numpy_ok: set[str] | None = None) -> None:
    """One rank's own state: its RNG ("rng") and its RankLocal entries ("local", an object of
    skeleton entries of kind "stateful"), naming only that rank's own tensors (`own`)."""
    check_value(state.get("rng"), own, where, numpy_ok=numpy_ok)
    local = state.get("local")
    if local is None:
        return
    if not isinstance(local, dict):
        raise FormatError(f"{where}: 'local' must be an object")
    for key, entry in local.items():
        if not isinstance(entry, dict) or entry.get("kind") != "stateful" or "value" not in entry:
            raise FormatError(f"{where}: local entry {key[:80]!r} is not {{'kind': 'stateful', 'value': ...}}")
        check_value(entry["value"], own, f"{where}, local entry {key[:80]!r}", numpy_ok=numpy_ok)


def check_value(value: Any, tensors: set[str], where: str, depth: int = 0, numpy_ok: set[str] | None = None) -> None:
    """A skeleton value: JSON with well-formed tags, naming only tensors in `tensors` (and, for
    $ndarray, in `numpy_ok`)."""
    if depth > MAX_DEPTH:
        raise FormatError(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, list):
        for v in value:
            check_value(v, tensors, where, depth + 1, numpy_ok)
        return
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**1024:
        raise FormatError(f"{where} holds an integer of more than 1024 bits")
    if not isinstance(value, dict):
        return
    tagged = [k for k in value if k in TAGS]
    if not tagged:
        for v in value.values():
            check_value(v, tensors, where, depth + 1, numpy_ok)
        return
    if len(value) != 1:
        raise FormatError(f"{where} has a tag {tagged[0]!r} beside other keys")
    ((tag, inner),) = value.items()
    if tag in ("$tensor", "$ndarray"):
        if not isinstance(inner, str) or inner not in tensors:
            raise FormatError(f"{where} refers to tensor {str(inner)[:80]!r}, which the manifest does not list for it")
        if tag == "$ndarray" and numpy_ok is not None and inner not in numpy_ok:
            raise FormatError(f"{where} stores tensor {inner[:80]!r} as a numpy array, which its dtype cannot be")
    elif tag == "$tuple":
        check_value(_list(inner, f"a $tuple in {where}"), tensors, where, depth + 1, numpy_ok)
    elif tag == "$items":
        for pair in _list(inner, f"the $items of {where}"):
            if not isinstance(pair, list) or len(pair) != 2:
                raise FormatError(f"{where} has an $items entry that is not a [key, value] pair")
            check_value(pair, tensors, where, depth + 1, numpy_ok)
            if not _key_ok(pair[0]):
                raise FormatError(f"{where} has an $items key that is not hashable")
    elif tag == "$float" and inner not in ("inf", "-inf", "nan"):
        raise FormatError(f"{where} has a $float that is not inf, -inf or nan")
    elif tag == "$bytes":
        try:
            base64.b64decode(inner if isinstance(inner, str) else b"!", validate=True)
        except (binascii.Error, ValueError):
            raise FormatError(f"{where} has a $bytes that is not base64 text") from None


def _key_ok(k: Any, lists: bool = True) -> bool:
    """Whether a decoded `k` is a hashable dict key: a scalar, a $float or $bytes, a $tuple of
    such, or a list of such (capture.py's _hashable turns a key's lists into tuples; a list
    inside a $tuple stays a list)."""
    if isinstance(k, list):
        return lists and all(_key_ok(x, lists) for x in k)
    if isinstance(k, dict):
        if len(k) != 1:
            return False
        ((tag, inner),) = k.items()
        if tag == "$tuple":
            return isinstance(inner, list) and all(_key_ok(x, False) for x in inner)
        return tag in ("$float", "$bytes")
    return True


def _list(v: Any, what: str) -> list[Any]:
    if not isinstance(v, list):
        raise FormatError(f"{what} is not a list")
    return v
