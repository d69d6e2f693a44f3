"""Reading one restore candidate on this rank, before the vote (restore/__init__.py).

Order: the manifest; its files' real sizes; the fit with the live state (before any live
byte is written); for the RAM tier, the files this node lacks, from peers; then one pass
over the chunks, each verified where it lands. Both readers return (what `load` needs or
None, this rank's ballot {"error": ..., "mismatch": [...]}).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from typing import Any

import psutil
import torch

from ftkit.coord.agree import agree
from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, FtkitError, StorageError
from ftkit.format.data import check_file_sizes, read_regions, torch_dtype
from ftkit.format.index import MAX_MANIFEST_BYTES, MAX_PART_BYTES
from ftkit.format.manifest import MANIFEST_NAME, Manifest, step_dir_name
from ftkit.format.reader import (
    load_index,
    load_manifest,
    manifest_from,
    missing_parts,
    parse_manifest_header,
    read_metadata,
)
from ftkit.format.validate import is_file_name
from ftkit.restore.context import RestoreContext
from ftkit.restore.plan import Candidate, fetch_plan, files_for
from ftkit.save import capture as cap
from ftkit.save.rng import rng_problems
from ftkit.save.sharding import RANK_LOCAL, dtensor_region, is_dtensor
from ftkit.tiers.peers import Transfer

log = logging.getLogger("ftkit")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere pages fault in as sent


def read_shared_candidate(rc: RestoreContext, step: int, storage):
    """Read and check this rank's part of a step on a shared tier, before the vote."""
    try:
        manifest = load_manifest(storage, step)
        check_file_sizes(storage, manifest)
        regions, dtensors, in_place, problems = _fit(rc, manifest)
        if problems:
            return None, {"error": None, "mismatch": problems}
    except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
        return None, {"error": str(e), "mismatch": []}
    return _read(rc, storage, step, manifest, regions, dtensors, in_place)


def _read(rc: RestoreContext, storage, step: int, manifest: Manifest, regions, dtensors, in_place):
    """One pass over the chunks: into the live tensors `in_place`, the rest into new ones."""
    try:
        with rc.arena.host_targets(in_place) as targets:  # device tensors: through a pinned slot
            # What the host has available now: the most it may allocate beyond the live tensors.
            free = int(psutil.virtual_memory().available)
            tensors = read_regions(storage, manifest, regions, out=targets, memory_limit=free)
        tensors.update(in_place)
        loaded = _finish(rc, step, manifest, tensors, dtensors)
    except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
        return None, {"error": str(e), "mismatch": []}
    return loaded, {"error": None, "mismatch": []}


def _fit(rc: RestoreContext, manifest: Manifest):
    """(regions, dtensors, in-place targets, fit problems) of `manifest` on this rank: the region
    of each saved tensor it loads (an orphan is never read), the live DTensors among
    them, the live tensors a whole saved tensor can be read straight into (plain, contiguous,
    on the CPU or a CUDA device, same shape and dtype: StagingArena.host_targets), and what keeps
    `manifest` from loading into the live state, from the manifest alone: tensors not yet read
    stand in as memoryless ones of their global shape and dtype."""
    live = dict(cap.capture(rc.state, rng=False, rng_path=f"{cap.RNG_KEY}/r{rc.dist.rank}").tensors)
    own = manifest.rank_state.get(str(rc.dist.rank), {})
    own_local = {k: e for k, e in (own.get("local") or {}).items() if isinstance(rc.state.get(k), cap.RankLocal)}
    # What it loads: the tensors its skeleton entries, RankLocal state and (when restored) RNG state name.
    needed = cap.tensor_refs(own.get("rng") if rc.rng else None)
    for e in (*manifest.skeleton["entries"].values(), *own_local.values()):
        needed |= cap.tensor_refs(e["value"])
    regions, dtensors, in_place, stand_ins = {}, {}, {}, {}
    for entry in manifest.tensors:
        if entry.name not in needed:
            continue
        t = live.get(entry.name)
        stand_ins[entry.name] = torch.empty((), dtype=torch_dtype(entry.dtype)).expand(entry.shape)
        if t is not None and entry.kind != RANK_LOCAL and is_dtensor(t) and tuple(t.shape) == tuple(entry.shape):
            regions[entry.name] = dtensor_region(t)[:2]
            dtensors[entry.name] = t
            continue
        regions[entry.name] = ((0,) * len(entry.shape), entry.shape)
        if (
            t is not None
            and t.device.type in ("cpu", "cuda")
            and t.is_contiguous()
            and not is_dtensor(t)
            and tuple(t.shape) == tuple(entry.shape)
            and str(t.dtype).removeprefix("torch.") == entry.dtype
        ):
            in_place[entry.name] = stand_ins[entry.name] = t
    return regions, dtensors, in_place, cap.check(rc.state, manifest.skeleton, stand_ins, own_local)


def read_ram_candidate(rc: RestoreContext, cand: Candidate, key: str, manifest: Manifest | None):
    """Read a step from the RAM tier, fetching files this node lacks from peers. Every rank
    takes part in every exchange even after a local error, so no rank waits on one that gave up."""
    ctx, step = rc.dist, cand.step
    backend = rc.backends[cand.tier]
    assert backend.node_local  # (planned from the RAM inventories: restore/plan.py ram_candidates)
    storage, peers = backend.storage, backend.peers
    step_dir = step_dir_name(step)
    error = _send_manifest(storage, step, ctx, key, cand) if ctx.distributed else None
    try:
        if manifest is None:
            manifest = _manifest(storage, step, ctx, key, cand)
        present = set(storage.list_sizes(step_dir))
        check_file_sizes(storage, manifest, present & set(manifest.files))  # peers check theirs before sending
        regions, dtensors, in_place, problems = _fit(rc, manifest)
        missing = sorted(files_for(manifest, regions) - present)
    except (FtkitError, OSError, ValueError) as e:  # ValueError: a store message that is not JSON
        error, missing, regions, dtensors, in_place, problems = str(e), [], {}, {}, {}, []
    origin: dict[str, Any] = {
        "source": "ram+peer" if missing else "ram",
        "files_from_peers": len(missing),
        "received": [],
    }
    mismatch, plan = _plan_fetches(ctx, f"{key}/req", cand, {"missing": missing, "mismatch": bool(problems)})
    if mismatch:  # known everywhere before any live byte is written
        return None, {"error": None, "mismatch": problems}, origin
    moved_error = None
    t_fetch = time.perf_counter()
    if plan:
        try:
            if peers is None or peers.broken:
                raise StorageError("files are on other nodes but there is no peer group to fetch them")
            if manifest is None:
                raise CorruptCheckpointError(f"step {step}: no manifest to fetch files by")
            sizes = {(t.src, t.file): manifest.files[_listed(manifest, t.file)]["bytes"] for t in plan}
            origin["received"] = peers.run(
                plan,
                lambda f: _read_file(storage, step_dir, f, manifest),
                lambda f, buf: _write_file(storage, step_dir, f, buf, manifest),
                sizes,
            )
        except Exception as e:
            moved_error = f"fetching RAM-tier files from peers failed: {e}"
    moved = agree(ctx, f"{key}/moved", error=moved_error)  # siblings' received files are in place now
    if plan:
        origin["fetch_s"] = time.perf_counter() - t_fetch
    error = error or moved.first_failure(ctx.rank)
    if error is not None:
        return None, {"error": error, "mismatch": []}, origin
    assert manifest is not None  # (no error: it was read above)
    return (*_read(rc, storage, step, manifest, regions, dtensors, in_place), origin)


def _send_manifest(storage, step: int, ctx, key: str, cand: Candidate) -> str | None:
    """Put into the store what the plan says this rank sends the nodes lacking the manifest:
    its manifest.json, the parts assigned to it. Returns what failed here, if anything."""
    step_dir = step_dir_name(step)
    error = None
    if ctx.rank == cand.manifest_rank:
        try:
            doc = read_metadata(storage, f"{step_dir}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES).decode()
        except Exception as e:  # the nodes that wait for it hear "" at once
            doc, error = "", str(e)
        ctx.put(f"{key}/manifest", doc)
    for name, rank in cand.part_holders.items():
        if rank == ctx.rank:
            try:
                data = read_metadata(storage, f"{step_dir}/{name}", MAX_PART_BYTES)
            except Exception as e:  # the readers' check of its checksum fails, at once
                data, error = b"", str(e)
            ctx.store.set(f"{key}/part/{name}", data)
    return error


def _manifest(storage, step: int, ctx, key: str, cand: Candidate) -> Manifest:
    """This node's manifest of `step`, completed with what other nodes sent: the index (or
    whole document) when it has none, the parts it lacks."""
    if storage.exists(f"{step_dir_name(step)}/{MANIFEST_NAME}"):
        data, index = load_index(storage, step)
    else:
        doc = ctx.get(f"{key}/manifest") if ctx.distributed else None
        if not doc:
            raise CorruptCheckpointError(f"step {step}: no rank could provide the RAM tier manifest")
        data = doc.encode()
        index = parse_manifest_header(data, f"RAM manifest of step {step}", step)
    remote = [name for name, _ in missing_parts(storage, step, index.parts)] if index is not None else []
    lost = [name for name in remote if name not in cand.part_holders]
    if lost:  # nobody will send it: do not wait for it
        raise CorruptCheckpointError(f"step {step}: manifest part {lost[0]} is on no node ({len(lost)} missing)")
    sent = dict(zip(remote, ctx.wait_get([f"{key}/part/{name}" for name in remote]), strict=True)) if remote else {}
    return manifest_from(storage, step, data, index, sent)


def _plan_fetches(ctx, key: str, cand: Candidate, request: dict[str, Any]) -> tuple[bool, list[Transfer]]:
    """(whether some rank's live state does not fit, the transfers of files between nodes):
    every rank sends rank 0 what it lacks; rank 0 plans and publishes the plan."""
    got = ctx.gather_to_root(key, request, range(ctx.world_size))
    if ctx.rank == 0:
        requests = [_request(got[r]) for r in range(ctx.world_size)]
        plan = fetch_plan(requests, cand.holders, ctx.nodes)
        mismatch = any(r.get("mismatch") for r in requests)
        decided = {"mismatch": mismatch, "plan": [[t.src, t.dst, t.file] for t in plan]}
    else:
        decided = None
    decided = ctx.broadcast(f"{key}/plan", decided)
    return bool(decided["mismatch"]), [Transfer(int(a), int(b), str(f)) for a, b, f in decided["plan"]]


def _request(doc: Any) -> dict[str, Any]:
    """A rank's fetch request as rank 0 reads it from the store (untrusted: anything else is empty)."""
    if not isinstance(doc, dict):
        return {}
    missing = doc.get("missing")
    files = [f for f in missing if is_file_name(f)] if isinstance(missing, list) else []
    return {"missing": files, "mismatch": doc.get("mismatch") is True}


def _finish(rc, step: int, manifest: Manifest, tensors, dtensors):
    """Wrap DTensor regions, pick this rank's RNG."""
    for name, t in dtensors.items():
        from torch.distributed.tensor import DTensor

        local = tensors[name].to(t.to_local().device)
        tensors[name] = DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    rng_value = None
    own = manifest.rank_state.get(str(rc.dist.rank), {})
    if rc.rng:
        rng_value = own.get("rng")
        if rng_value is None:
            log.info(
                "step %d holds no RNG state for rank %d (saved with %d ranks); RNG left as is",
                step,
                rc.dist.rank,
                manifest.world_size,
            )
        else:
            try:
                problems = rng_problems(cap.decode(rng_value, tensors))
            except KeyError as e:
                problems = [f"it names tensor {e} that this rank did not read"]
            if problems:
                raise CorruptCheckpointError(
                    f"step {step}: the RNG state of rank {rc.dist.rank} is unusable: {'; '.join(problems)}"
                )
    local_value = own.get("local")
    if local_value is None and any(isinstance(v, cap.RankLocal) for v in rc.state.values()):
        log.info(
            "step %d holds no rank-local state for rank %d (saved with %d ranks); those entries left as they are",
            step,
            rc.dist.rank,
            manifest.world_size,
        )
    return manifest, tensors, (rng_value, local_value)


def _listed(manifest, name: Any) -> str:
    """A file name from a peer's request (a store message: untrusted): one the manifest lists."""
    if not isinstance(name, str) or name not in manifest.files:
        raise CorruptCheckpointError(f"a peer asked for {str(name)[:80]!r}, which the manifest does not list")
    return name


def _read_file(storage, step_dir: str, name: str, manifest) -> torch.Tensor:
    """A data file to send to a peer: its page-cache pages themselves when the file is local."""
    size = manifest.files[_listed(manifest, name)]["bytes"]
    if size and storage.is_local:
        with open(storage.path(f"{step_dir}/{name}"), "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size >= size:
                # No copy into fresh memory; the tensor keeps the mapping alive until the send
                # is done, and gloo only reads it.
                mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "not writable": nobody writes it
                    return torch.frombuffer(mapped, dtype=torch.uint8)
    buf = torch.empty(size, dtype=torch.uint8)  # a short file sends what it has; the receiver's checksum says so
    with storage.open_read(f"{step_dir}/{name}") as f:
        if size:
            f.readinto(buf.numpy().data)
    return buf


def _write_file(storage, step_dir: str, name: str, buf: torch.Tensor, manifest) -> None:
    with storage.open_write(f"{step_dir}/{_listed(manifest, name)}", recycle=True) as f:
        f.write(buf.numpy().data)


def init_sharded_optimizers(state) -> None:
    """Give empty optimizers over DTensor parameters their state, so it can be resharded into."""
    for obj in state.values():
        if (
            isinstance(obj, torch.optim.Optimizer)
            and not obj.state
            and any(is_dtensor(p) for g in obj.param_groups for p in g["params"])
        ):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(obj)
