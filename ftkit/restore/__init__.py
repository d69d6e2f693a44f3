"""Restore: choose the newest step that is complete somewhere, read it, vote, load.

Order of calls (every rank runs `restore` together)::

    inventory   each rank lists its node's RAM tier: committed steps, files held
    candidates  rank 0 merges the inventories and lists the shared tiers, then
                publishes (step, source) pairs: newest step first; for a step,
                RAM first (when its files are all on some node), then shared
                tiers from fastest to slowest
    per candidate, until one is usable:
        fit     each rank works out the regions it needs (resharding when the
                world size changed) and checks shapes, dtypes and keys against
                the live state from the manifest alone: a mismatch raises
                before any byte of the live state is touched
        read    for the RAM source, files its node lacks are sent by a rank
                whose node holds them, over the peer group; then every needed
                chunk is read and its checksum verified
        vote    every rank reports ok / error through the store
        load    only when every rank read its part intact, all load in place

Tensors whose live counterpart is a plain contiguous CPU tensor of the saved
shape and dtype are read straight into it, not into a fresh copy of the state,
in one pass before the vote: every chunk is read once and verified as it lands
(a second pass would cost as much again, and a file changed between two passes
would reach the live state unverified). When a chunk fails anywhere, every rank
moves on to the next candidate, which rewrites every live byte this one touched
(validation proved that a step's chunks tile each tensor exactly). So a corrupt
replica, a torn file or a crafted manifest never ends up loaded; when NO
candidate verifies, restore raises CorruptCheckpointError and the live tensors
may hold part of one (do not train on them).

After a successful restore of step N every newer step is taken out of the
timeline (`_retire_newer`): dropped from the RAM tier, retired on shared tiers.
Nothing is dropped or retired before then: a failed candidate destroys nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
import warnings
from typing import Any

import torch

from ftkit.save import capture as cap
from ftkit.errors import CheckpointNotFoundError, CorruptCheckpointError, FtkitError, StateMismatchError, StorageError
from ftkit.format.manifest import MANIFEST_NAME, Manifest, manifest_from_json, step_dir_name
from ftkit.tiers.peers import Transfer
from ftkit.tiers.lifecycle import RETIRED_MANIFEST, delete_step, retire_step
from ftkit.format.reader import check_file_sizes, load_manifest, read_regions, scan, torch_dtype
from ftkit.save.sharding import RANK_LOCAL, dtensor_region, is_dtensor, overlap

log = logging.getLogger("ftkit")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere pages fault in as sent


def restore(ck, step: int | None) -> int:
    ctx = ck._ctx
    key = f"restore/{ck._restores}"
    ck._restores += 1
    t_start = time.perf_counter()
    inventory, manifests = _ram_inventory(ck)
    inventories = ctx.gather(f"{key}/inv", inventory)
    listing = _list_candidates(ck, step, inventories) if ctx.rank == 0 else None
    listing = ctx.broadcast(f"{key}/candidates", listing)
    candidates, unreachable = listing["candidates"], listing["unreachable"]
    t_plan = time.perf_counter() - t_start
    if step is not None and not candidates:
        raise CheckpointNotFoundError(f"step {step} is not committed on any tier "
                                      f"({', '.join(s.display_url for s in ck._storages)})")
    problems: list[str] = []
    for n, cand in enumerate(candidates):
        s, i = cand["step"], cand["tier"]
        storage = ck._storages[i]
        t0 = time.perf_counter()
        if ck.tiers[i].is_ram:
            loaded, vote, origin = _read_ram_candidate(ck, cand, f"{key}/{n}", manifests.get(s))
        else:
            loaded, vote = _read_candidate(ck, s, storage)
            origin = {"source": storage.display_url}
        t_read = time.perf_counter() - t0
        votes = ctx.gather(f"{key}/vote/{n}", vote)
        mismatched = [(r, v["mismatch"]) for r, v in enumerate(votes) if v["mismatch"]]
        if mismatched:
            r, found = mismatched[0]
            raise StateMismatchError(cap.describe(found) + ("" if r == ctx.rank else f" (on rank {r})"))
        failed = [(r, v["error"]) for r, v in enumerate(votes) if v["error"]]
        if failed:
            r, err = failed[0]
            problems.append(err)
            log.warning("step %d from %s is unusable, trying the next source: %s%s", s,
                        origin.get("source", storage.display_url), err, "" if r == ctx.rank else f" (on rank {r})")
            continue
        manifest, tensors, rng_value = loaded
        t1 = time.perf_counter()
        cap.load(ck.state, manifest.skeleton, tensors, rng_value)
        t_load = time.perf_counter() - t1
        retired = _retire_newer(ck, s, f"{key}/retired")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        ck.last_restore = {"step": s, **origin, "bytes": nbytes, "saved_world_size": manifest.world_size,
                           "plan_s": t_plan, "read_s": t_read, "load_s": t_load,
                           "total_s": time.perf_counter() - t_start, "retired": retired}
        ck.events.emit("restore", **{k: v for k, v in ck.last_restore.items() if k != "received"})
        log.info("rank %d restored step %d from %s: %.1f MB (plan %.2fs, read %.2fs%s, load %.2fs)%s%s",
                 ctx.rank, s, origin["source"], nbytes / 1e6, t_plan, t_read,
                 f" of which fetching from peers {origin['fetch_s']:.2f}s" if "fetch_s" in origin else "", t_load,
                 f"; {origin['files_from_peers']} file(s) from peers" if origin.get("files_from_peers") else "",
                 f"; saved by {manifest.world_size} ranks, resharded to {ctx.world_size}"
                 if manifest.world_size != ctx.world_size else "")
        return s
    if problems:
        raise CorruptCheckpointError(f"no usable checkpoint: {len(problems)} candidate(s) failed, so the live "
                                     f"state may hold part of one; newest problem: {problems[0]}")
    if unreachable:
        raise StorageError(f"no checkpoint found and a tier could not be read: {unreachable[0]}")
    _retire_newer(ck, 0, f"{key}/retired")  # incomplete RAM steps (no manifest anywhere) go too
    ck.events.emit("restore", step=0, source=None, total_s=time.perf_counter() - t_start)
    return 0


def _retire_newer(ck, step: int, key: str) -> dict[str, list[int]]:
    """After restoring `step` (0: starting afresh), take every newer step out of the timeline.

    They belong to a future the run has left: an explicit `restore(step=N)`, or a
    fallback past newer steps that failed. Left in place, the run's next snapshots
    of those step numbers would be refused as already committed and a later
    restart would resume the abandoned future. The RAM tier drops them (node
    leaders; it is a cache); shared tiers retire them (rank 0; lifecycle.py: the
    manifest is renamed aside, the bytes stay until retention). Runs only once a
    restore has succeeded, so a failed candidate destroys nothing; ends with a
    barrier, so no rank snapshots before every newer step is gone. Returns
    {tier URL: steps retired} (this rank's share of the work)."""
    ctx = ck._ctx
    out: dict[str, list[int]] = {}
    for i, tier in enumerate(ck.tiers):
        storage = ck._storages[i]
        if tier.is_peer or not (ctx.node_leader(ctx.rank) if tier.is_ram else ctx.rank == 0):
            continue
        try:
            dirs = [d for d in scan(storage) if d.step > step and (tier.is_ram or d.committed)]
        except StorageError as e:
            log.warning("rank %d: cannot list %s to retire steps newer than %d: %s", ctx.rank,
                        storage.display_url, step, e)
            continue
        for d in dirs:
            try:
                if tier.is_ram:
                    delete_step(storage, d.step)
                else:
                    retire_step(storage, d.step)
                out.setdefault(storage.display_url, []).append(d.step)
            except StorageError as e:
                log.warning("rank %d: could not retire step %d of %s: %s", ctx.rank, d.step, storage.display_url, e)
        committed = [d.step for d in dirs if d.committed]
        if committed and step > 0:
            log.warning("ftkit: restored step %d, so newer step(s) %s of %s are %s: this run continues from step "
                        "%d", step, committed, storage.display_url,
                        "dropped" if tier.is_ram else f"retired (renamed to {RETIRED_MANIFEST})", step)
    if ctx.distributed:
        ctx.gather(key, None)  # nobody snapshots before every node's newer steps are gone
    return out


# ------------------------------------------------------------------ planning
def _ram_inventory(ck) -> tuple[dict[str, Any], dict[int, Manifest]]:
    """What this rank's node holds in the RAM tier: {step: {"have": [...], "need": [...]}},
    and the manifests parsed on the way (the read of a candidate reuses them)."""
    i = ck._ram_index
    manifests: dict[int, Manifest] = {}
    if i is None:
        return {}, manifests
    storage = ck._storages[i]
    out: dict[str, Any] = {}
    try:
        for d in scan(storage):
            names = [n for n, kind in storage.list_dir(step_dir_name(d.step)) if kind == "file"]
            have = [n for n in names if n.endswith(".data")]
            need = None
            if d.committed:
                try:
                    manifests[d.step] = load_manifest(storage, d.step)
                    need = sorted(manifests[d.step].files)
                except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                    log.warning("RAM tier manifest of step %d is unusable: %s", d.step, e)
            out[str(d.step)] = {"have": have, "need": need}
    except StorageError as e:
        log.warning("cannot list the RAM tier: %s", e)
    return out, manifests


def _list_candidates(ck, step: int | None, inventories: list[dict[str, Any]]) -> dict[str, Any]:
    """(step, source) candidates, newest step first and fastest source first."""
    options: dict[int, list[dict[str, Any]]] = {}
    unreachable: list[str] = []
    if ck._ram_index is not None:
        for s, cand in _ram_candidates(ck, inventories).items():
            options.setdefault(s, []).append(cand)
    order = sorted((i for i, t in enumerate(ck.tiers) if not (t.is_ram or t.is_peer)),
                   key=lambda i: ck.tiers[i].speed_rank)
    for i in order:
        try:
            steps = [d.step for d in scan(ck._storages[i]) if d.committed]
        except StorageError as e:
            log.warning("cannot list %s: %s", ck._storages[i].display_url, e)
            unreachable.append(str(e))
            continue
        for s in steps:
            options.setdefault(s, []).append({"step": s, "tier": i})
    wanted = [step] if step is not None else sorted(options, reverse=True)
    return {"candidates": [c for s in wanted for c in options.get(s, [])], "unreachable": unreachable}


def _ram_candidates(ck, inventories: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """RAM steps whose every file is on some node (on every node, without peers)."""
    ctx = ck._ctx
    by_step: dict[int, dict[str, Any]] = {}
    for rank, inv in enumerate(inventories):
        for s, info in inv.items():
            entry = by_step.setdefault(int(s), {"holders": {}, "need": None, "manifest_rank": None, "nodes": {}})
            for f in info["have"]:
                entry["holders"].setdefault(f, []).append(rank)
            entry["nodes"].setdefault(ctx.nodes[rank], set()).update(info["have"])
            if info["need"] is not None and entry["need"] is None:
                entry["need"], entry["manifest_rank"] = info["need"], rank
    out = {}
    for s, e in by_step.items():
        if e["need"] is None:
            continue
        need = set(e["need"])
        if ck._peers is not None and not ck._peers.broken:
            complete = need <= set(e["holders"])
        else:  # no transport between nodes: every node must hold everything
            complete = all(need <= e["nodes"].get(n, set()) for n in set(ctx.nodes))
        if complete:  # the manifest goes through the store only when a node lacks it
            lacking = any(inv.get(str(s), {}).get("need") is None for inv in inventories)
            out[s] = {"step": s, "tier": ck._ram_index, "holders": e["holders"],
                      "manifest_rank": e["manifest_rank"] if lacking else None}
    return out


# ------------------------------------------------------------------- reading
def _regions(ck, manifest: Manifest):
    """The region of each saved tensor this rank needs, the live DTensors among them, and the live tensors."""
    _init_sharded_optimizers(ck.state)
    live = dict(cap.capture(ck.state, rng=False).tensors)
    rank_prefix = f"{cap.RNG_KEY}/r{ck._ctx.rank}/"
    regions, dtensors = {}, {}
    for entry in manifest.tensors:
        full = ((0,) * len(entry.shape), entry.shape)
        if entry.kind == RANK_LOCAL:
            if entry.name.startswith(rank_prefix):
                regions[entry.name] = full
            continue
        t = live.get(entry.name)
        if t is not None and is_dtensor(t) and tuple(t.shape) == tuple(entry.shape):
            offsets, lengths, _ = dtensor_region(t)
            regions[entry.name] = (offsets, lengths)
            dtensors[entry.name] = t
        else:
            regions[entry.name] = full
    return regions, dtensors, live


def _fit_problems(ck, manifest: Manifest, regions, in_place) -> list[str]:
    """What keeps `manifest` from loading into the live state, decided from the manifest alone.

    Saved tensors not yet read stand in as memoryless tensors of their global
    shape and dtype (a DTensor compares by global shape too).
    """
    entries = {t.name: t for t in manifest.tensors}
    stand_ins = {}
    for name in regions:
        if name in in_place:
            stand_ins[name] = in_place[name]
        else:
            e = entries[name]
            stand_ins[name] = torch.empty((), dtype=torch_dtype(e.dtype)).expand(e.shape)
    return cap.check(ck.state, manifest.skeleton, stand_ins)


def _finish(ck, step: int, manifest: Manifest, tensors, dtensors):
    """Wrap DTensor regions, pick this rank's RNG."""
    for name, t in dtensors.items():
        from torch.distributed.tensor import DTensor

        local = tensors[name].to(t.to_local().device)
        tensors[name] = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                           shape=t.shape, stride=t.stride())
    rng_value = None
    if ck.rng:
        rng_value = manifest.rank_state.get(str(ck._ctx.rank), {}).get("rng")
        if rng_value is None:
            log.info("step %d holds no RNG state for rank %d (saved with %d ranks); RNG left as is",
                     step, ck._ctx.rank, manifest.world_size)
        else:
            try:
                problems = cap.rng_problems(cap.decode(rng_value, tensors))
            except KeyError as e:
                problems = [f"it names tensor {e} that this rank did not read"]
            if problems:
                raise CorruptCheckpointError(f"step {step}: the RNG state of rank {ck._ctx.rank} is unusable: "
                                             f"{'; '.join(problems)}")
    return manifest, tensors, rng_value


def _read_candidate(ck, step: int, storage):
    """Read and check this rank's part of a step on a shared tier, before the vote.

    Order: the manifest (validated), the sizes of its files against storage
    (before anything is allocated on its word), the fit with the live state (a
    mismatch is known before any live byte is written), then one pass over the
    chunks: tensors whose live counterpart is a plain contiguous CPU tensor of the
    saved shape and dtype are read straight into it, verified chunk by chunk; the
    rest into new tensors, loaded after the vote. A failure anywhere makes this
    rank vote "error"; every rank then moves on to the next candidate, which
    rewrites every live byte this one touched (the chunks of a valid step tile
    every tensor exactly).
    """
    try:
        manifest = load_manifest(storage, step)
        check_file_sizes(storage, manifest)
        regions, dtensors, live = _regions(ck, manifest)
        in_place = _in_place_targets(live, manifest, regions, dtensors)
        problems = _fit_problems(ck, manifest, regions, in_place)
        if problems:
            return None, {"error": None, "mismatch": problems}
        with ck._arena.host_targets(in_place) as targets:  # device tensors: through a pinned slot
            tensors = read_regions(storage, manifest, regions, out=targets)
        tensors.update(in_place)
        loaded = _finish(ck, step, manifest, tensors, dtensors)
    except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
        return None, {"error": str(e), "mismatch": []}
    return loaded, {"error": None, "mismatch": []}


def _in_place_targets(live, manifest: Manifest, regions, dtensors) -> dict[str, torch.Tensor]:
    """Live tensors a whole saved tensor can be read straight into: plain, contiguous, on the CPU or a
    CUDA device (read through a pinned staging slot, see StagingArena.host_targets), same shape and dtype."""
    out = {}
    for entry in manifest.tensors:
        t = live.get(entry.name)
        if t is None or entry.name in dtensors or entry.name not in regions:
            continue
        whole = regions[entry.name] == ((0,) * len(entry.shape), entry.shape)
        if whole and t.device.type in ("cpu", "cuda") and t.is_contiguous() and not is_dtensor(t) \
                and tuple(t.shape) == tuple(entry.shape) and str(t.dtype).removeprefix("torch.") == entry.dtype:
            out[entry.name] = t
    return out


def _read_ram_candidate(ck, cand: dict[str, Any], key: str, manifest: Manifest | None):
    """Read a step from the RAM tier, fetching files this node lacks from peers.

    Every rank takes part in every exchange below even after a local error (it
    then only reports the error), so no rank waits on one that gave up.
    """
    ctx, step = ck._ctx, cand["step"]
    storage = ck._storages[ck._ram_index]
    step_dir = step_dir_name(step)
    error: str | None = None
    # The manifest: parsed by the inventory, or from this node, or from the rank named by the plan.
    if ctx.rank == cand["manifest_rank"] and ctx.distributed:
        try:
            ctx.put(f"{key}/manifest", storage.read_bytes(f"{step_dir}/{MANIFEST_NAME}").decode())
        except Exception as e:
            ctx.put(f"{key}/manifest", "")
            error = str(e)
    try:
        if manifest is None and storage.exists(f"{step_dir}/{MANIFEST_NAME}"):
            manifest = load_manifest(storage, step)
        if manifest is None:
            doc = ctx.get(f"{key}/manifest")
            if not doc:
                raise CorruptCheckpointError(f"step {step}: no rank could provide the RAM tier manifest")
            manifest = manifest_from_json(doc.encode(), f"RAM manifest of step {step}", expect_step=step)
        present = set(storage.list_sizes(step_dir))
        check_file_sizes(storage, manifest, present & set(manifest.files))  # peers check theirs before sending
        regions, dtensors, live = _regions(ck, manifest)
        in_place = _in_place_targets(live, manifest, regions, dtensors)
        problems = _fit_problems(ck, manifest, regions, in_place)
        needed = _files_for(manifest, regions)
        missing = sorted(needed - present)
    except (FtkitError, OSError, ValueError) as e:  # ValueError: a store message that is not JSON
        error, missing, regions, dtensors, in_place, problems = str(e), [], {}, {}, {}, []
    requests = ctx.gather(f"{key}/req", {"missing": missing, "error": error, "mismatch": problems})
    origin = {"source": "ram+peer" if missing else "ram", "files_from_peers": len(missing), "received": []}
    if any(r["mismatch"] for r in requests):  # known everywhere before any live byte is written
        return None, {"error": None, "mismatch": problems}, origin
    plan = _fetch_plan(requests, cand["holders"], ctx.nodes)
    moved_error = None
    received: list[str] = []
    t_fetch = time.perf_counter()
    if plan:
        try:
            if ck._peers is None or ck._peers.broken:
                raise StorageError("files are on other nodes but there is no peer group to fetch them")
            sizes = {(t.src, t.file): manifest.files[_listed(manifest, t.file)]["bytes"] for t in plan}
            received = ck._peers.run(plan, lambda f: _read_file(storage, step_dir, f, manifest),
                                     lambda f, buf: _write_file(storage, step_dir, f, buf, manifest), sizes)
        except Exception as e:
            moved_error = f"fetching RAM-tier files from peers failed: {e}"
    moved = ctx.gather(f"{key}/moved", moved_error)  # siblings' received files are in place now
    if plan:
        origin["fetch_s"] = time.perf_counter() - t_fetch
    error = error or moved_error or next((m for m in moved if m), None)
    if error is None:
        try:  # one pass: straight into the live tensors, each chunk verified there (module docstring)
            with ck._arena.host_targets(in_place) as targets:  # device tensors: through a pinned slot
                tensors = read_regions(storage, manifest, regions, out=targets)
            tensors.update(in_place)
        except (CorruptCheckpointError, StorageError, CheckpointNotFoundError) as e:
            error = str(e)
    origin["received"] = received
    if error is None:
        try:
            loaded = _finish(ck, step, manifest, tensors, dtensors)
        except CorruptCheckpointError as e:
            error = str(e)
    if error is not None:
        return None, {"error": error, "mismatch": []}, origin
    return loaded, {"error": None, "mismatch": []}, origin


def _files_for(manifest: Manifest, regions) -> set[str]:
    files = set()
    for t in manifest.tensors:
        if t.name not in regions:
            continue
        offs, lens = regions[t.name]
        for s in t.shards:
            if overlap(offs, lens, s.offsets, s.lengths) is not None or not lens:
                files.update(c.file for c in s.chunks)
    return files


def _fetch_plan(requests: list[dict[str, Any]], holders: dict[str, list[int]], nodes: list[str]) -> list[Transfer]:
    """One transfer per (node, file) that node lacks, to one of the node's ranks that need it.

    Receiving and storing are spread over those ranks (a lost node's ranks lack the
    same files; one of them receiving everything would store it all alone), and
    sending over the holders on other nodes.
    """
    wanted: dict[tuple[str, str], list[int]] = {}
    for rank, req in enumerate(requests):
        for f in req["missing"]:
            wanted.setdefault((nodes[rank], f), []).append(rank)
    plan, received_by = [], {}
    for (node, f), ranks in wanted.items():
        sources = [h for h in holders.get(f, []) if nodes[h] != node]
        if not sources:
            continue
        dst = min(ranks, key=lambda r: (received_by.get(r, 0), r))  # the least loaded so far
        received_by[dst] = received_by.get(dst, 0) + 1
        plan.append(Transfer(sources[len(plan) % len(sources)], dst, f))
    return plan


def _listed(manifest, name: Any) -> str:
    """A file name from a peer's request (a store message: untrusted): one the manifest lists."""
    if manifest is None or not isinstance(name, str) or name not in manifest.files:
        raise CorruptCheckpointError(f"a peer asked for {str(name)[:80]!r}, which the manifest does not list")
    return name


def _read_file(storage, step_dir: str, name: str, manifest) -> torch.Tensor:
    """A data file to send to a peer: its page-cache pages themselves when the file is local."""
    size = manifest.files[_listed(manifest, name)]["bytes"]
    if size and storage.is_local:
        fd = os.open(storage.path(f"{step_dir}/{name}"), os.O_RDONLY)
        try:
            if os.fstat(fd).st_size >= size:
                # Mapped and populated in one call: no copy into fresh memory (which costs
                # several times a read, in page faults). The tensor keeps the mapping alive
                # until the send is done; gloo only reads it.
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "not writable": nobody writes it
                    return torch.frombuffer(mapped, dtype=torch.uint8)
        finally:
            os.close(fd)
    buf = torch.empty(size, dtype=torch.uint8)  # a short file sends what it has; the receiver's checksum says so
    with storage.open_read(f"{step_dir}/{name}") as f:
        if size:
            f.readinto(memoryview(buf.numpy()))
    return buf


def _write_file(storage, step_dir: str, name: str, buf: torch.Tensor, manifest) -> None:
    with storage.open_write(f"{step_dir}/{_listed(manifest, name)}", recycle=True) as f:
        f.write(memoryview(buf.numpy()))


def _init_sharded_optimizers(state) -> None:
    """Give empty optimizers over DTensor parameters their state, so it can be resharded into."""
    for obj in state.values():
        if isinstance(obj, torch.optim.Optimizer) and not obj.state and any(
                is_dtensor(p) for g in obj.param_groups for p in g["params"]):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(obj)
