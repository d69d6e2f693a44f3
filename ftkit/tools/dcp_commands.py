"""`ftkit ls`, `inspect`, `verify` and `restore` on checkpoints DCP itself wrote (dcp/foreign.py):
a URL with DCP's ``.metadata``, or subdirectories that have one (torchtitan's ``step-N``), and
no ftkit step. DCP stores no checksums: `verify` says what it checked, and never more."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch

from ftkit.dcp import foreign
from ftkit.dcp.storage import step_of
from ftkit.errors import AlreadyCommitted, CheckpointNotFoundError, CorruptCheckpointError, FtkitError, UsageError
from ftkit.format.reader import scan
from ftkit.tiers.storage import Storage
from ftkit.tools.cliutil import EXIT_FAIL, EXIT_OK, emit, human, open_url

NO_CHECKSUMS = "DCP stores no checksums: every item read back whole, at its size; a changed byte cannot be seen"


def dcp_checkpoints(storage: Storage) -> list[str]:
    """The DCP checkpoints at `storage` when it holds no ftkit step (else []). A listing that
    fails raises: trying DCP's layout, then ftkit's again, would wait out a dead store thrice."""
    if scan(storage):
        return []
    return foreign.checkpoints(storage)


def _step(storage: Storage, rel: str) -> int | None:
    """The step a DCP checkpoint is: the number its folder's name ends in (``checkpoint/step-N/``);
    the URL's own, when it is one checkpoint, as a checkpoint_id names a step (None: it names none)."""
    if rel:
        return foreign._number(rel)
    try:
        return step_of(storage.url)
    except FtkitError:
        return None


def _pick(storage: Storage, found: list[str], step: int | None) -> str:
    if step is None:
        return found[-1]
    for name in found:
        if _step(storage, name) == step:
            return name
    raise CheckpointNotFoundError(f"{storage.display_url}: no DCP checkpoint of step {step} (have: {found})")


def ls(args, storage: Storage, found: list[str]) -> int:
    rows = []
    for rel in found:
        try:
            tensors, values = foreign.describe(foreign.metadata(storage, rel))
            rows.append(
                {
                    "checkpoint": storage.where(rel),
                    "step": _step(storage, rel),
                    "status": "dcp",
                    "tensors": len(tensors),
                    "values": len(values),
                    "raw_bytes": sum(t["bytes"] for t in tensors),
                }
            )
        except CorruptCheckpointError as e:
            rows.append({"checkpoint": storage.where(rel), "status": "bad-dcp", "error": str(e)})
    lines = [f"{'CHECKPOINT':<60} {'STATUS':<8} {'TENSORS':>7} {'RAW':>10}"]
    for r in rows:
        if r["status"] == "dcp":
            lines.append(f"{r['checkpoint'][-60:]:<60} {'dcp':<8} {r['tensors']:>7} {human(r['raw_bytes']):>10}")
        else:
            lines.append(f"{r['checkpoint'][-60:]:<60} {r['status']:<8} {r['error']}")
    lines.append("(DCP checkpoints: pickled metadata, read trusting the directory; no checksums)")
    emit(args, {"url": storage.display_url, "format": "dcp", "checkpoints": rows}, "\n".join(lines))
    return EXIT_OK


def inspect(args, storage: Storage, found: list[str]) -> int:
    rel = _pick(storage, found, args.step)
    md = foreign.metadata(storage, rel)
    tensors, values = foreign.describe(md)
    payload = {
        "checkpoint": storage.where(rel),
        "format": "dcp",
        "version": getattr(md, "version", None),
        "tensor_list": tensors,
        "values": values,
    }
    lines = [
        f"DCP checkpoint at {storage.where(rel)} (version {payload['version'] or '?'})",
        f"  {len(tensors)} tensors, {human(sum(t['bytes'] for t in tensors))} raw; {len(values)} other values",
        "",
        f"  {'TENSOR':<56} {'DTYPE':<10} {'SHAPE':<22} {'CHUNKS':>6}",
    ]
    for t in tensors:
        lines.append(f"  {t['name'][:56]:<56} {t['dtype']:<10} {str(tuple(t['shape']))[:22]:<22} {t['chunks']:>6}")
    emit(args, payload, "\n".join(lines))
    return EXIT_OK


def verify(args, storage: Storage, found: list[str]) -> int:
    picked = found if getattr(args, "all", False) else [_pick(storage, found, args.step)]
    results: list[dict[str, Any]] = []
    for rel in picked:
        try:
            n, nbytes = foreign.verify(storage, rel)
            results.append({"checkpoint": storage.where(rel), "ok": True, "tensors": n, "bytes": nbytes})
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:
            results.append({"checkpoint": storage.where(rel), "ok": False, "error": str(e)})
    ok = all(r["ok"] for r in results)
    lines = [f"{r['checkpoint']}: " + ("OK" if r["ok"] else f"FAILED: {r['error']}") for r in results]
    lines.append(f"({NO_CHECKSUMS})")
    emit(
        args,
        {"url": storage.display_url, "format": "dcp", "ok": ok, "checked": NO_CHECKSUMS, "checkpoints": results},
        "\n".join(lines),
    )
    return EXIT_OK if ok else EXIT_FAIL


def restore(args, storage: Storage, found: list[str]) -> int:
    """A DCP checkpoint to one torch or safetensors file, or (--world-size M) to an ftkit checkpoint;
    the options are checked already (commands.cmd_restore)."""
    from ftkit.tools.export import write_file

    rel = _pick(storage, found, args.step)
    if args.format == "dcp":
        raise UsageError("the source is a DCP checkpoint already")
    sd = foreign.read_all(storage, rel)
    step = _step(storage, rel) or 0
    if getattr(args, "world_size", None) is not None:
        return _to_ftkit(args, storage, rel, sd, max(step, 0))
    if args.format != "torch":  # safetensors: the tensors by name
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        sd = {k: v for k, v in flatten_state_dict(sd)[0].items() if isinstance(v, torch.Tensor)}
    write_file(args.out, args.format, sd, {"ftkit_source": "dcp"})
    emit(
        args,
        {"checkpoint": storage.where(rel), "out": args.out, "format": args.format},
        f"restored the DCP checkpoint {storage.where(rel)} to {args.out} ({args.format})",
    )
    return EXIT_OK


def _to_ftkit(args, storage: Storage, rel: str, sd: dict[str, Any], step: int) -> int:
    """Through ftkit's DCP writer (one process: an ftkit step of world size 1), then resharded."""
    import torch.distributed.checkpoint as dcp

    from ftkit.dcp import FtkitStorageWriter
    from ftkit.format.reader import load_manifest
    from ftkit.tools.reshard import reshard

    work = tempfile.mkdtemp(prefix="ftkit-dcp-")
    try:
        writer = FtkitStorageWriter([{"url": work, "keep": None}])
        # (DCP's CheckpointException is a BaseException: a value ftkit cannot store without pickle, one line)
        with foreign._dcp_errors(FtkitError, f"{storage.where(rel)}: cannot be written as an ftkit step"):
            dcp.save(sd, storage_writer=writer, checkpoint_id=step, no_dist=True)
        src = Storage(work)
        dst = open_url(args, args.out)
        new = reshard(src, load_manifest(src, step), dst, args.world_size)
    except AlreadyCommitted:  # as from an ftkit checkpoint (commands.py _reshard): the user's choice of --out
        raise UsageError(f"{dst.display_url} already holds step {step}; choose another --out") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(
        args,
        {"checkpoint": storage.where(rel), "out": dst.display_url, "step": step, "world_size": new.world_size},
        f"wrote the DCP checkpoint {storage.where(rel)} as ftkit step {step} for {new.world_size} rank(s) "
        f"to {dst.display_url}",
    )
    return EXIT_OK
