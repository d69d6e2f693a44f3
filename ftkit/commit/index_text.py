"""Rank 0's index bytes without re-encoding what the last steps' indexes already held.

An index (format/index.py) is a few hundred bytes per node plus the skeleton, which is most
of it (7 kB of a tiny GPT's 8 kB) and nearly the same at every step: the model's and the
optimizer state's tensor placeholders never change, the optimizer's param groups and the
scheduler's counters do. `json.dumps` of the whole was about a third of rank 0's commit
(bench_dist.py). Here the skeleton and its dict of entries are taken apart, and every
container below them is looked up by its `marshal` bytes (one C call, a fifth to a seventh
of the encode): a key seen before gives back its JSON text; on a miss a small dict (an entry's
kind and value, a state dict's two halves) is taken apart in turn. `marshal` is exact where
`==` is not (1, 1.0 and True, 0.0 and -0.0 are equal but encode differently): equal bytes,
equal values, equal text. The result is byte for byte
`format.index.encode_index(doc)` (tests/unit/test_format_index.py).
"""

from __future__ import annotations

import json
import marshal
from typing import Any

from ftkit.commit.memo import Lru

_DEPTH = 6  # how far down a skeleton's small dicts are taken apart
_KEYED_BELOW = 5  # the skeleton and its entries are only taken apart (one change anywhere changes them)
_FEW = 8  # a dict of this many keys or fewer is structure (entries, an entry, a state dict's halves): taken apart
_SMALL = 256  # marshal bytes under which a container is encoded again (a counter, a learning rate)
_LARGE = 1 << 20  # above it, not kept (sixteen of those is memory enough for an index of this size)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _text(value: Any, depth: int, texts: Lru[bytes, str]) -> str:
    """`value`'s JSON text. A container is looked up by its marshal bytes; on a miss a small
    dict is taken apart, so that its unchanged children are found again."""
    if type(value) not in (dict, list):
        return _dumps(value)
    small = depth > 0 and type(value) is dict and len(value) <= _FEW and all(type(k) is str for k in value)
    if small and depth >= _KEYED_BELOW:
        return _join(value, depth, texts)
    try:
        key = marshal.dumps(value)
    except ValueError:  # not plain data: json.dumps says what is wrong
        return _dumps(value)
    if len(key) < _SMALL:
        return _dumps(value)
    if len(key) > _LARGE:
        return _join(value, depth, texts) if small else _dumps(value)
    text = texts.get(key)
    if text is None:
        text = _join(value, depth, texts) if small else _dumps(value)
    texts.put(key, text)  # (a hit too: what every step reuses stays)
    return text


def _join(value: dict[str, Any], depth: int, texts: Lru[bytes, str]) -> str:
    return "{" + ",".join(f"{_dumps(k)}:{_text(v, depth - 1, texts)}" for k, v in value.items()) + "}"


def encode_index_reusing(doc: dict[str, Any], texts: Lru[bytes, str]) -> bytes:
    """format.index.encode_index(doc) (format.index.index_doc's: its keys are strings), the
    skeleton's unchanged containers from `texts` (marshal bytes of a container -> its JSON
    text: a step adds a few, what changed and the levels above it; what every step reuses
    is put again at each hit and stays; CommitMemo.index_texts)."""
    items = (f"{_dumps(k)}:{_text(v, _DEPTH, texts) if k == 'skeleton' else _dumps(v)}" for k, v in doc.items())
    return ("{" + ",".join(items) + "}").encode()
