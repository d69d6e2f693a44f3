"""DCP's view of a checkpoint and ftkit's, translated both ways: pure functions, no I/O.

Each DCP tensor is a tensor entry whose shards are DCP's chunks; each non-tensor value a
skeleton entry in JSON (no pickle); the planner's data and DCP's version ride in the
manifest's ``writer`` record, from which `metadata_of` rebuilds DCP's Metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftkit.errors import CaptureError
from ftkit.format.manifest import Manifest
from ftkit.save import capture as cap
from ftkit.save.write import dtype_name

DCP_KEY = "dcp"  # the manifest writer record's key for what DCP needs back


def encode_value(fqn: str, value: Any) -> Any:
    """A DCP non-tensor value as a skeleton value (JSON with ftkit's tags); CaptureError for
    anything only pickle could hold (a function, an arbitrary object)."""
    enc = cap._Encoder()
    out = enc.encode(value, fqn)
    if enc.tensors:
        raise CaptureError(f"cannot store {fqn!r}: a non-tensor item of DCP's plan holds tensors")
    return out


def manifest_parts(
    metadata: Any, results: list[list[Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """(tensor entry docs, skeleton, files, DCP's record) of a step from DCP's `metadata` and
    every rank's write results (`results[rank]`); each stored tensor chunk becomes a shard."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shards: dict[str, list[dict[str, Any]]] = {}
    values: dict[str, Any] = {}
    files: dict[str, dict[str, Any]] = {}
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            data = r.storage_data
            if data["file"] is not None:
                files[data["file"]] = {"bytes": data["file_bytes"], "rank": rank}
            if "value" in data:
                values[r.index.fqn] = data["value"]
                continue
            shards.setdefault(r.index.fqn, []).append(
                {
                    "offsets": list(data["offsets"]),
                    "lengths": list(data["lengths"]),
                    "rank": rank,
                    "chunks": data["chunks"],
                }
            )
    tensors: list[dict[str, Any]] = []
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors.append(
                {
                    "name": fqn,
                    "dtype": dtype_name(md.properties.dtype),
                    "shape": list(md.size),
                    "kind": "sharded" if len(md.chunks) > 1 else "replicated",
                    "shards": shards.get(fqn, []),
                }
            )
            entries[fqn] = {"kind": "tensor", "value": {"$tensor": fqn}}
        else:
            entries[fqn] = {"kind": "value", "value": values.get(fqn)}
    record = {
        "version": getattr(metadata, "version", None),
        "planner_data": _jsonable_planner_data(getattr(metadata, "planner_data", None)),
    }
    return tensors, {"entries": entries}, files, record


def _jsonable_planner_data(data: Any) -> Any:
    """DefaultSavePlanner's planner data ({fqn: its state_dict path}) as JSON lists; None for
    anything else (a custom planner's own data)."""
    plain = lambda fqn, path: (
        isinstance(fqn, str)
        and isinstance(path, (tuple, list))
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
    )
    if not isinstance(data, Mapping) or not all(plain(fqn, path) for fqn, path in data.items()):
        return None
    return {fqn: list(path) for fqn, path in data.items()}


def metadata_of(manifest: Manifest) -> Any:
    """DCP's Metadata of an ftkit step: a tensor item per tensor (a chunk per shard), a bytes
    item per other skeleton entry; storage_data maps each chunk to its shard."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for t in manifest.tensors:
        if t.kind == "rank-local":
            continue
        chunks = []
        for si, s in enumerate(t.shards):
            if not s.lengths or all(n > 0 for n in s.lengths):
                chunks.append(ChunkStorageMetadata(torch.Size(s.offsets), torch.Size(s.lengths)))
                storage[MetadataIndex(t.name, s.offsets)] = si
        md[t.name] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, t.dtype)), torch.Size(t.shape), chunks)
    for key in manifest.skeleton["entries"]:
        if key not in md:
            md[key] = BytesStorageMetadata()
    version = _record(manifest).get("version")
    version = version if isinstance(version, str) else None
    return Metadata(md, planner_data=planner_paths(manifest), storage_data=storage, version=version)


def _record(manifest: Manifest) -> dict[str, Any]:
    record = manifest.writer.get(DCP_KEY)
    return record if isinstance(record, dict) else {}


def planner_paths(manifest: Manifest) -> dict[str, tuple[Any, ...]] | None:
    """The state_dict path of every item of a step DCP wrote through ftkit (its planner data),
    or None for a step ftkit's Checkpointer wrote (whose skeleton is nested already)."""
    planner = _record(manifest).get("planner_data")
    if not isinstance(planner, dict):
        return None
    return {k: tuple(v) for k, v in planner.items() if isinstance(v, list)}


def skeleton_value(manifest: Manifest, fqn: str) -> Any:
    """The decoded value of a non-tensor item; KeyError if the step has none of that name."""
    entry = manifest.skeleton["entries"][fqn]
    if entry["kind"] == "tensor":
        raise KeyError(fqn)
    return cap.decode(entry["value"], {})
