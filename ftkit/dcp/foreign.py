"""DCP checkpoints written by DCP itself (torchtitan's step folders, accelerate's, Lightning's
and Megatron's DCP formats), and ftkit steps written out as DCP checkpoints (`export_step`).

A directory (or fsspec URL) holding DCP's ``.metadata``, or whose subdirectories do, is
listed, inspected, verified and restored by the command line, and loaded into a live state
(`load_into`). DCP's metadata is pickled: reading it trusts the directory. DCP stores no
checksums: `verify` proves only that every item reads back whole at its declared size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, FtkitError, StorageError, UsageError, one_line
from ftkit.save.write import dtype_name
from ftkit.tiers.storage import Storage

log = logging.getLogger("ftkit")
METADATA = ".metadata"
_trust_said = False  # (warned once a process)


def checkpoints(storage: Storage) -> list[str]:
    """The DCP checkpoints at `storage`'s root: [""] when the root is one, else its subdirectories
    that are, by the number their name ends in, then by name."""
    try:
        entries = dict(storage.list_dir(""))
    except StorageError:
        return []
    if entries.get(METADATA) == "file":
        return [""]
    found = []
    for name, kind in entries.items():
        if kind == "directory" and dict(storage.list_dir(name)).get(METADATA) == "file":
            found.append(name)
    return sorted(found, key=lambda n: (_number(n), n))


def _number(name: str) -> int:
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return int(digits[-1]) if digits else -1


def _reader(storage: Storage, rel: str) -> Any:
    path = storage.path(rel)
    global _trust_said
    if not _trust_said:
        _trust_said = True
        log.warning("%s is a DCP checkpoint: reading its pickled metadata trusts the directory", storage.where(rel))
    if storage.is_local:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(path)
    from torch.distributed.checkpoint import FsspecReader

    opts = getattr(storage.fs, "storage_options", None)
    return FsspecReader(storage.url + (f"/{rel}" if rel else ""), **(opts if isinstance(opts, Mapping) else {}))


def metadata(storage: Storage, rel: str = "") -> Any:
    """DCP's Metadata of the checkpoint at `rel` (pickled: trusting the directory)."""
    return _metadata_of(_reader(storage, rel), storage.where(rel))


def _metadata_of(reader: Any, where: str) -> Any:
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where}: no DCP metadata ({METADATA})") from None
    except Exception as e:  # an unpickling error, a torn file: DCP's own reader says what
        raise CorruptCheckpointError(f"{where}: DCP metadata unreadable: {one_line(e)}") from None


def _loading_reader(storage: Storage, rel: str) -> Any:
    """DCP's reader of the checkpoint at `rel` for a load, its metadata read here first: a missing or
    torn ``.metadata`` fails in one line, where DCP's load would log a traceback for it, look for
    per-rank metadata that its own writer never makes, and fail with both reasons."""
    reader = _reader(storage, rel)
    md = _metadata_of(reader, storage.where(rel))
    reader.read_metadata = lambda *args, **kwargs: md  # (read once: DCP's load asks again)
    return reader


def describe(md: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """(tensors: name, dtype, shape, chunks, bytes; the non-tensor items' names) of a Metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, values = [], []
    for fqn, item in sorted(md.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            tensors.append(
                {
                    "name": fqn,
                    "dtype": dtype_name(item.properties.dtype),
                    "shape": list(item.size),
                    "chunks": len(item.chunks),
                    "bytes": int(torch.Size(item.size).numel()) * item.properties.dtype.itemsize,
                }
            )
        else:
            values.append(fqn)
    return tensors, values


def read_all(storage: Storage, rel: str = "") -> dict[str, Any]:
    """The whole checkpoint as a nested state dict of full tensors and values (a missing or torn
    file fails here, naming it)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict[str, Any] = {}
    reader = _loading_reader(storage, rel)
    with _dcp_errors(CorruptCheckpointError, f"{storage.where(rel)}: DCP checkpoint unreadable"):
        _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


@contextlib.contextmanager
def _dcp_errors(error: type[FtkitError], what: str, remove: str | None = None) -> Iterator[None]:
    """DCP's failure as `error`, one line: the last of what went wrong (its CheckpointException is a
    BaseException wrapping each rank's traceback). `remove`: a directory deleted on any failure."""
    try:
        yield
    except BaseException as e:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(e).strip().splitlines()
        raise error(f"{what}: {text[-1][:300] if text else type(e).__name__}") from None


def verify(storage: Storage, rel: str = "") -> tuple[int, int]:
    """(tensors, bytes) of a DCP checkpoint that reads back whole; CorruptCheckpointError if an
    item does not. DCP keeps no checksums: this cannot tell a changed byte."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    tensors, _ = describe(metadata(storage, rel))
    flat, _ = flatten_state_dict(read_all(storage, rel))  # keyed by DCP's own FQNs (lists too)
    for t in tensors:
        got = flat.get(t["name"])
        if not isinstance(got, torch.Tensor) or list(got.shape) != t["shape"]:
            raise CorruptCheckpointError(f"{storage.where(rel)}: {t['name']} did not read back as {t['shape']}")
    return len(tensors), sum(t["bytes"] for t in tensors)


def load_into(state: MutableMapping[str, Any], url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Load the DCP checkpoint at `url` into a Checkpointer's live `state` (its keys the
    checkpoint's top-level keys: ``{"model": ..., "optim": ...}``), resharded by DCP to the
    live world. Every rank calls it. An optimizer loads with the state's one module, other
    objects through their state_dict, tensors in place, plain values by assignment."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    model = modules[0] if len(modules) == 1 else None
    sd: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            sd[key] = get_model_state_dict(obj)
        elif isinstance(obj, torch.optim.Optimizer) and model is not None:
            sd[key] = get_optimizer_state_dict(model, obj)
        elif callable(getattr(obj, "state_dict", None)):
            sd[key] = obj.state_dict()
        else:
            sd[key] = obj
    storage = Storage(url, dict(storage_options or {}))
    reader = _loading_reader(storage, "")
    with _dcp_errors(FtkitError, f"{storage.display_url}: the DCP checkpoint does not load into the live state"):
        dcp.load(sd, storage_reader=reader)
    for key, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, sd[key])
        elif isinstance(obj, torch.optim.Optimizer) and model is not None:
            set_optimizer_state_dict(model, obj, sd[key])
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(sd[key])
        elif isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(sd[key])
        else:
            state[key] = sd[key]


def export_step(storage: Storage, manifest: Any, out: str, progress: Any = None, overwrite: bool = False) -> None:
    """Write a committed ftkit step as a DCP checkpoint directory at `out`, the state as the
    training code held it. `overwrite` (``--force``): what is at `out` is replaced only once
    the new directory is whole (written beside it, then swapped in)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    from ftkit.format.data import read_tensors
    from ftkit.tools.export import to_nested

    empty_dir = os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)
    taken = os.path.lexists(out) and not empty_dir
    if taken and not overwrite:
        raise UsageError(f"{out} already exists and is not empty; remove it or pass --force")
    if taken:
        check_replaceable(storage, out)
    sd = to_nested(manifest, read_tensors(storage, manifest, progress=progress))
    sd.pop("_ftkit", None)
    target = _beside(out)  # whole before it takes `out`'s name: a failed export leaves nothing there
    with _dcp_errors(FtkitError, f"{out}: DCP could not write the step", remove=target):
        _save_state_dict(sd, storage_writer=FileSystemWriter(target), no_dist=True)
    if taken:
        _swap_in(target, out)
        return
    try:
        if empty_dir:
            os.rmdir(out)
        os.rename(target, out)
    except OSError as e:
        shutil.rmtree(target, ignore_errors=True)
        raise FtkitError(f"{out}: cannot move the export into place: {e.strerror or e}") from None


def check_replaceable(storage: Storage, out: str) -> None:
    """What `--force` may replace: not a link or a mount point (a rename cannot move it), and
    nothing that holds the tier read from or lies inside it."""
    if os.path.islink(out) or os.path.ismount(out):
        raise UsageError(f"{out} is a symbolic link or a mount point; --force cannot replace it, choose another --out")
    if storage.is_local:
        tier, there = os.path.realpath(storage.root), os.path.realpath(out)
        if os.path.commonpath([tier, there]) in (tier, there):
            raise UsageError(f"{out} holds or lies inside the checkpoint tier {storage.root}; choose another --out")


def _beside(out: str) -> str:
    """A new directory next to `out` (same filesystem: a rename swaps it in), with the umask."""
    parent = os.path.dirname(os.path.abspath(out))
    path = os.path.join(parent, f".{os.path.basename(out)}.tmp-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
    except OSError as e:
        raise FtkitError(f"{out}: cannot write beside it in {parent}: {e.strerror}") from None
    return path


def _swap_in(new: str, out: str) -> None:
    """The old `out` aside, `new` in its place, the old one removed; if the second rename
    fails, the old one goes back."""
    old = f"{new}.old"
    try:
        os.rename(out, old)
    except OSError as e:
        shutil.rmtree(new, ignore_errors=True)
        raise FtkitError(f"{out}: cannot be moved aside to replace it: {e.strerror}") from None
    try:
        os.rename(new, out)
    except OSError as e:
        os.rename(old, out)
        shutil.rmtree(new, ignore_errors=True)
        raise FtkitError(f"{out}: the new export could not take its place: {e.strerror}") from None
    if os.path.isdir(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.remove(old)
