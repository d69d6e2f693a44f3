"""The `ftkit` commands that read checkpoints: ls, inspect, verify, restore (and export), report.
A URL that holds DCP checkpoints and no ftkit step goes to tools/dcp_commands.py."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from ftkit.errors import AlreadyCommitted, CheckpointNotFoundError, CorruptCheckpointError, StorageError, UsageError
from ftkit.format.data import verify
from ftkit.format.manifest import Manifest
from ftkit.format.reader import load_manifest, newest_manifest, scan
from ftkit.format.validate import MAX_WORLD
from ftkit.tiers.storage import Storage
from ftkit.tools import dcp_commands
from ftkit.tools.cliutil import EXIT_FAIL, EXIT_OK, emit, human, open_tier, open_url, progress_bar, summary, when
from ftkit.tools.dcp_commands import dcp_checkpoints


def cmd_ls(args) -> int:
    storage, _ = open_tier(args)
    if found := dcp_checkpoints(storage):
        return dcp_commands.ls(args, storage, found)
    rows: list[dict[str, Any]] = []
    notes = {
        "partial": "no manifest: not a checkpoint",
        "retired": "retired: superseded by a restore of an older step",
        "link": "a symbolic link: ignored",
        "bad": "manifest.json is not a regular file: ignored",
    }
    for sd in scan(storage):
        if not sd.committed:
            rows.append({"step": sd.step, "status": sd.status})
            continue
        try:
            rows.append({**summary(load_manifest(storage, sd.step)), "status": "committed"})
        except CorruptCheckpointError as e:
            rows.append({"step": sd.step, "status": "bad-manifest", "error": str(e)})
    listed = storage.incomplete_uploads()
    uploads = [u for u in listed if u["own"]]
    foreign = [u for u in listed if not u["own"]]
    if not rows and not uploads:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    lines = [f"{'STEP':>10}  {'STATUS':<12} {'WORLD':>5} {'TENSORS':>7} {'STORED':>10} {'RAW':>10}  CREATED"]
    for r in rows:
        if r["status"] == "committed":
            lines.append(
                f"{r['step']:>10}  {r['status']:<12} {r['world_size']:>5} {r['tensors']:>7} "
                f"{human(r['stored_bytes']):>10} {human(r['raw_bytes']):>10}  {when(r['created_at'])}"
            )
        else:
            lines.append(
                f"{r['step']:>10}  {r['status']:<12} {'-':>5} {'-':>7} {'-':>10} {'-':>10}  "
                f"{r.get('error', notes.get(r['status'], ''))}"
            )
    payload: dict[str, Any] = {"url": storage.display_url, "steps": rows}
    own = "incomplete multipart upload(s) (a writer died mid-upload; `ftkit gc` aborts them)"
    alien = "foreign incomplete upload(s) below this prefix (not ftkit's files; gc leaves them alone)"
    for key, group, what in (("incomplete_uploads", uploads, own), ("foreign_uploads", foreign, alien)):
        payload[key] = [{"key": u["key"], "initiated": u["initiated"]} for u in group]
        if group:
            more = " ..." if len(group) > 3 else ""
            lines.append(f"{len(group)} {what}: {', '.join(u['key'] for u in group[:3])}{more}")
    emit(args, payload, "\n".join(lines))
    return EXIT_OK


def cmd_inspect(args) -> int:
    storage, step = open_tier(args)
    if found := dcp_checkpoints(storage):
        return dcp_commands.inspect(args, storage, found)
    m = newest_manifest(storage, step)
    tensors: list[dict[str, Any]] = []
    for t in m.tensors:
        chunks = [c for s in t.shards for c in s.chunks]
        tensors.append(
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "shards": len(t.shards),
                "stored_bytes": sum(c.length for c in chunks),
                "raw_bytes": sum(c.raw_length for c in chunks),
                "codecs": sorted({c.codec for c in chunks}),
            }
        )
    payload = {**summary(m), "url": storage.display_url, "files": m.files, "writer": m.writer, "tensor_list": tensors}
    payload["parts"] = m.parts  # {name: {"bytes", "checksum"}} of the manifest's part files
    lines = [
        f"step {m.step} at {storage.display_url}",
        f"  format v{m.format_version}, world size {m.world_size}, created {when(m.created_at)}, "
        f"written by ftkit {m.writer.get('ftkit', '?')} / torch {m.writer.get('torch', '?')}",
        f"  {len(m.tensors)} tensors, {human(m.total_raw_bytes)} raw, {human(m.total_stored_bytes)} stored "
        f"in {len(m.files)} file(s)" + (f"; manifest in {len(m.parts)} part(s)" if m.parts else ""),
        f"  state entries: {', '.join(payload['entries']) or '-'}",
        "",
    ]
    lines.append(f"  {'TENSOR':<48} {'DTYPE':<10} {'SHAPE':<20} {'STORED':>10}  CODEC")
    for row in tensors:
        lines.append(
            f"  {row['name'][:48]:<48} {row['dtype']:<10} {str(tuple(row['shape']))[:20]:<20} "
            f"{human(row['stored_bytes']):>10}  {'+'.join(row['codecs']) or '-'}"
        )
    emit(args, payload, "\n".join(lines))
    return EXIT_OK


def cmd_verify(args) -> int:
    storage, step = open_tier(args)
    if args.all and step is not None:
        raise UsageError("--all verifies every step: give it or a step (--step N, or a step directory), not both")
    if found := dcp_checkpoints(storage):
        return dcp_commands.verify(args, storage, found)
    if args.all:
        # A manifest or step directory that is a link (`ls`: bad, link) is a step that fails, not none.
        steps = [s.step for s in scan(storage) if s.committed or s.status in ("bad", "link")]
        if not steps:
            raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    else:
        steps = [step if step is not None else newest_manifest(storage).step]
    results: list[dict[str, Any]] = []
    for s in steps:
        try:
            m = load_manifest(storage, s)
            with progress_bar(m.total_raw_bytes, f"verify step {s}") as update:
                verify(storage, m, progress=update)
            results.append({"step": s, "ok": True, "bytes": m.total_stored_bytes})
        except (CorruptCheckpointError, CheckpointNotFoundError, StorageError) as e:  # (as gc's survey)
            results.append({"step": s, "ok": False, "error": str(e)})
    ok = all(r["ok"] for r in results)
    lines = [f"step {r['step']}: " + ("OK" if r["ok"] else f"FAILED: {r['error']}") for r in results]
    emit(args, {"url": storage.display_url, "ok": ok, "steps": results}, "\n".join(lines))
    return EXIT_OK if ok else EXIT_FAIL


def cmd_restore(args) -> int:
    """`ftkit restore` and `ftkit export`, of an ftkit step or (dcp_commands.restore) a DCP checkpoint."""
    from ftkit.tools.export import export

    resharding = getattr(args, "world_size", None) is not None  # (`ftkit export` has no --world-size)
    if resharding and not 1 <= args.world_size <= MAX_WORLD:
        raise UsageError(f"--world-size must be from 1 to {MAX_WORLD}")
    if resharding and args.format != "torch":
        raise UsageError("--world-size writes an ftkit checkpoint directory; --format does not apply")
    to_file = not resharding and args.format != "dcp"
    if to_file and os.path.isdir(args.out):
        raise UsageError(f"{args.out} is a directory; --out names the file to write")
    if to_file and os.path.lexists(args.out) and not args.force:
        raise UsageError(f"{args.out} already exists; remove it or pass --force")
    storage, step = open_tier(args)
    if to_file and os.path.lexists(args.out):  # --force: never a file of the tier read from
        from ftkit.dcp.foreign import check_replaceable

        check_replaceable(storage, args.out)
    if found := dcp_checkpoints(storage):
        return dcp_commands.restore(args, storage, found)
    m = newest_manifest(storage, step)
    if resharding:
        return _reshard(args, storage, m)
    if args.format == "dcp":  # written by DCP's own writer
        from ftkit.dcp.foreign import export_step

        with progress_bar(m.total_raw_bytes, f"export step {m.step}") as update:
            export_step(storage, m, args.out, progress=update, overwrite=args.force)
        text = f"wrote step {m.step} of {storage.display_url} as a DCP checkpoint to {args.out} ("
    else:
        with progress_bar(m.total_raw_bytes, f"restore step {m.step}") as update:
            export(storage, m, args.out, args.format, progress=update)
        text = f"restored step {m.step} from {storage.display_url} to {args.out} ({args.format}, "
    payload = {"step": m.step, "out": args.out, "format": args.format, "bytes": m.total_raw_bytes}
    emit(args, payload, f"{text}{human(m.total_raw_bytes)})")
    return EXIT_OK


def _reshard(args, storage: Storage, m: Manifest) -> int:
    from ftkit.tools.reshard import reshard

    dst = open_url(args, args.out)
    try:
        with progress_bar(m.total_raw_bytes, f"reshard step {m.step}") as update:
            new = reshard(storage, m, dst, args.world_size, progress=update)
    except AlreadyCommitted:
        raise UsageError(f"{dst.display_url} already holds step {m.step}; choose another --out") from None
    emit(
        args,
        {"step": m.step, "out": dst.display_url, "world_size": new.world_size, "files": len(new.files)},
        f"wrote step {m.step} for {new.world_size} rank(s) to {dst.display_url} "
        f"(from {m.world_size} rank(s), {len(new.files)} file(s))",
    )
    return EXIT_OK


def cmd_report(args) -> int:
    from ftkit.coord.events import read_event_log
    from ftkit.tools.report import analyze, to_html, to_text

    if not os.path.isdir(os.path.join(args.run_dir, "events")):
        raise CheckpointNotFoundError(f"{args.run_dir}: no events/ directory (is it an ftkit run directory?)")
    events, skipped = read_event_log(args.run_dir)
    if not events:
        unreadable = f" ({skipped} unreadable line(s) skipped)" if skipped else ""
        raise CheckpointNotFoundError(f"{args.run_dir}: the event log is empty{unreadable}")
    report = analyze(events)
    report.skipped_lines = skipped
    if args.html:
        page = to_html(report, events, title=f"ftkit run {os.path.basename(os.path.abspath(args.run_dir))}")
        try:
            with open(args.html, "w") as f:
                f.write(page)
        except OSError as e:
            raise StorageError(f"{args.html}: cannot write the timeline ({e.strerror or e})") from None
    emit(args, asdict(report), to_text(report) + (f"\ntimeline written to {args.html}" if args.html else ""))
    return EXIT_OK
