"""What the `ftkit` commands share: opening a tier URL, output, progress bars."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ftkit.errors import UnknownProtocolError, UsageError
from ftkit.format.manifest import Manifest, parse_step_dir
from ftkit.tiers.storage import Storage

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def open_tier(args) -> tuple[Storage, int | None]:
    """The tier at args.url; a URL ending in a step directory selects that step."""
    url = args.url.rstrip("/") or args.url  # ("/" is the root, not "")
    step = getattr(args, "step", None)
    head, slash, tail = url.rpartition("/")
    if slash and (named := parse_step_dir(tail)) is not None:
        url, step = head, (step if step is not None else named)
    return open_url(args, url), step


def open_url(args, url: str) -> Storage:
    """Storage at `url` (the source, or a restore's --out tier) with --storage-options."""
    options: dict[str, Any] = {}
    if args.storage_options:
        try:
            options = json.loads(args.storage_options)
        except json.JSONDecodeError as e:
            raise UsageError(f"--storage-options is not valid JSON: {e.msg}") from None
        if not isinstance(options, dict):
            raise UsageError("--storage-options must be a JSON object")
    try:
        return Storage(url, options)
    except UnknownProtocolError as e:
        raise UsageError(str(e)) from None


@contextmanager
def progress_bar(total: int, desc: str) -> Iterator[Any]:
    """A tqdm bar on a terminal, nothing otherwise. Yields an update(n) callable."""
    if not sys.stderr.isatty() or total <= 0:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def summary(m: Manifest) -> dict[str, Any]:
    return {
        "step": m.step,
        "world_size": m.world_size,
        "tensors": len(m.tensors),
        "raw_bytes": m.total_raw_bytes,
        "stored_bytes": m.total_stored_bytes,
        "created_at": m.created_at,
        "format_version": m.format_version,
        "entries": sorted(m.skeleton.get("entries", {})),
    }


def emit(args, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2))
    else:
        print(text)
