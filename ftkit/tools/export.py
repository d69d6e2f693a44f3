"""Export a checkpoint step to a single torch or safetensors file.

The torch file holds the state as the training code held it (``obj["model"]`` for
``load_state_dict``) plus ``"_ftkit"``. It loads with ``torch.load(path, weights_only=True)`` when the state holds
tensors and plain Python values only; numpy arrays and other objects need ``weights_only=False``.
The safetensors file holds the tensors by ftkit name and the JSON skeleton in its metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ftkit.errors import FtkitError, StorageError, one_line
from ftkit.format.data import read_tensors
from ftkit.format.manifest import Manifest
from ftkit.save import capture as cap
from ftkit.tiers.storage import Storage


def to_nested(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state as the training code held it, plus "_ftkit" (step, world size)."""
    from ftkit.dcp.convert import planner_paths

    entries = manifest.skeleton.get("entries", {})
    out: dict[str, Any] = {k: cap.decode(e["value"], tensors) for k, e in entries.items()}
    paths = planner_paths(manifest)
    if paths:  # a step DCP wrote through ftkit: its planner data nests DCP's flat FQNs
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        out = unflatten_state_dict({k: v for k, v in out.items() if k in paths}, paths) | {
            k: v for k, v in out.items() if k not in paths
        }
    out["_ftkit"] = {"step": manifest.step, "world_size": manifest.world_size}
    return out


def export(
    storage: Storage,
    manifest: Manifest,
    out_path: str,
    fmt: str,
    *,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Read and verify `manifest`'s step, then write it to `out_path` atomically (`fmt` and an
    existing `out_path` are checked by the caller, commands.cmd_restore)."""
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise FtkitError(f"{parent}: output directory does not exist")
    tensors = read_tensors(storage, manifest, progress=progress)
    meta = {"ftkit_step": str(manifest.step), "ftkit_skeleton": json.dumps(manifest.skeleton)}
    write_file(out_path, fmt, to_nested(manifest, tensors) if fmt == "torch" else tensors, meta)


def write_file(out_path: str, fmt: str, state: dict[str, Any], metadata: dict[str, str]) -> None:
    """Write `state` to `out_path` atomically: a torch file, or a safetensors file (`state`: tensors
    by name) with `metadata`. A failed write is a StorageError in one line."""
    if fmt == "torch":
        save: Callable[[str], Any] = lambda path: torch.save(state, path)  # noqa: E731
    else:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise FtkitError("--format safetensors needs the safetensors package: pip install safetensors") from None
        tensors = {k: v.contiguous() for k, v in state.items()}
        save = lambda path: save_file(tensors, path, metadata=metadata)  # noqa: E731
    tmp = f"{out_path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save(tmp)
        os.replace(tmp, out_path)
    except Exception as e:  # OSError, torch's RuntimeError, SafetensorError
        full = shutil.disk_usage(os.path.dirname(os.path.abspath(out_path))).free < (1 << 20)
        raise StorageError(f"writing {out_path} failed{' (the disk is full)' if full else ''}: {one_line(e)}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
