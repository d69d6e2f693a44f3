"""The `ftkit` command line: ls, inspect, verify, restore, gc.

Exit codes: 0 success; 1 a checkpoint is missing, corrupt or unreadable (or
storage failed); 2 a usage error (bad flags, unknown URL protocol, bad JSON in
--storage-options, an output that already exists). Expected errors print one
line, ``ftkit: error: ...``, and no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ftkit import __version__
from ftkit.errors import (
    AlreadyCommitted,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FtkitError,
    InvalidJobIdError,
    RunIdentityError,
    UnknownProtocolError,
    UsageError,
)
from ftkit.format.manifest import Manifest, parse_step_dir
from ftkit.format.reader import load_manifest, newest_manifest, scan, verify
from ftkit.tiers.storage import Storage

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


# ------------------------------------------------------------------- helpers
def _open(args) -> tuple[Storage, int | None]:
    """The tier at args.url; a URL ending in a step directory selects that step."""
    options: dict[str, Any] = {}
    if args.storage_options:
        try:
            options = json.loads(args.storage_options)
        except json.JSONDecodeError as e:
            raise UsageError(f"--storage-options is not valid JSON: {e.msg}") from None
        if not isinstance(options, dict):
            raise UsageError("--storage-options must be a JSON object")
    url = args.url.rstrip("/")
    step = getattr(args, "step", None)
    tail = url.rsplit("/", 1)[-1]
    if parse_step_dir(tail) is not None and "/" in url:
        url, step = url.rsplit("/", 1)[0], (step if step is not None else parse_step_dir(tail))
    try:
        storage = Storage(url, options)
    except UnknownProtocolError as e:
        raise UsageError(str(e)) from None
    return storage, step


@contextmanager
def _progress(total: int, desc: str) -> Iterator[Any]:
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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _summary(m: Manifest) -> dict[str, Any]:
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


def _emit(args, payload: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2))
    else:
        print(text)


# ------------------------------------------------------------------ commands
def cmd_ls(args) -> int:
    storage, _ = _open(args)
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
            rows.append({**_summary(load_manifest(storage, sd.step)), "status": "committed"})
        except CorruptCheckpointError as e:
            rows.append({"step": sd.step, "status": "bad-manifest", "error": str(e)})
    uploads = storage.incomplete_uploads()
    if not rows and not uploads:
        raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    lines = [f"{'STEP':>10}  {'STATUS':<12} {'WORLD':>5} {'TENSORS':>7} {'STORED':>10} {'RAW':>10}  CREATED"]
    for r in rows:
        if r["status"] == "committed":
            lines.append(
                f"{r['step']:>10}  {r['status']:<12} {r['world_size']:>5} {r['tensors']:>7} "
                f"{_human(r['stored_bytes']):>10} {_human(r['raw_bytes']):>10}  {_when(r['created_at'])}"
            )
        else:
            lines.append(
                f"{r['step']:>10}  {r['status']:<12} {'-':>5} {'-':>7} {'-':>10} {'-':>10}  "
                f"{r.get('error', notes.get(r['status'], ''))}"
            )
    if uploads:
        lines.append(
            f"{len(uploads)} incomplete multipart upload(s) (a writer died mid-upload; `ftkit gc` aborts "
            f"them): {', '.join(u['key'] for u in uploads[:3])}{' ...' if len(uploads) > 3 else ''}"
        )
    _emit(
        args,
        {
            "url": storage.display_url,
            "steps": rows,
            "incomplete_uploads": [{"key": u["key"], "initiated": u["initiated"]} for u in uploads],
        },
        "\n".join(lines),
    )
    return EXIT_OK


def cmd_inspect(args) -> int:
    storage, step = _open(args)
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
    payload = {**_summary(m), "url": storage.display_url, "files": m.files, "writer": m.writer, "tensor_list": tensors}
    lines = [
        f"step {m.step} at {storage.display_url}",
        f"  format v{m.format_version}, world size {m.world_size}, created {_when(m.created_at)}, "
        f"written by ftkit {m.writer.get('ftkit', '?')} / torch {m.writer.get('torch', '?')}",
        f"  {len(m.tensors)} tensors, {_human(m.total_raw_bytes)} raw, {_human(m.total_stored_bytes)} stored "
        f"in {len(m.files)} file(s)",
        f"  state entries: {', '.join(payload['entries']) or '-'}",
        "",
    ]
    lines.append(f"  {'TENSOR':<48} {'DTYPE':<10} {'SHAPE':<20} {'STORED':>10}  CODEC")
    for row in tensors:
        lines.append(
            f"  {row['name'][:48]:<48} {row['dtype']:<10} {str(tuple(row['shape']))[:20]:<20} "
            f"{_human(row['stored_bytes']):>10}  {'+'.join(row['codecs']) or '-'}"
        )
    _emit(args, payload, "\n".join(lines))
    return EXIT_OK


def cmd_verify(args) -> int:
    storage, step = _open(args)
    if args.all:
        steps = [s.step for s in scan(storage) if s.committed]
        if not steps:
            raise CheckpointNotFoundError(f"{storage.display_url}: no checkpoint found")
    else:
        steps = [step if step is not None else newest_manifest(storage).step]
    results: list[dict[str, Any]] = []
    for s in steps:
        try:
            m = load_manifest(storage, s)
            with _progress(m.total_raw_bytes, f"verify step {s}") as update:
                verify(storage, m, progress=update)
            results.append({"step": s, "ok": True, "bytes": m.total_stored_bytes})
        except (CorruptCheckpointError, CheckpointNotFoundError) as e:
            results.append({"step": s, "ok": False, "error": str(e)})
    ok = all(r["ok"] for r in results)
    lines = [f"step {r['step']}: " + ("OK" if r["ok"] else f"FAILED: {r['error']}") for r in results]
    _emit(args, {"url": storage.display_url, "ok": ok, "steps": results}, "\n".join(lines))
    return EXIT_OK if ok else EXIT_FAIL


def cmd_restore(args) -> int:
    from ftkit.tools.export import export

    storage, step = _open(args)
    m = newest_manifest(storage, step)
    if args.world_size is not None:
        return _reshard(args, storage, m)
    if os.path.exists(args.out) and not args.force:
        raise UsageError(f"{args.out} already exists; remove it or pass --force")
    with _progress(m.total_raw_bytes, f"restore step {m.step}") as update:
        export(storage, m, args.out, args.format, overwrite=args.force, progress=update)
    _emit(
        args,
        {"step": m.step, "out": args.out, "format": args.format, "bytes": m.total_raw_bytes},
        f"restored step {m.step} from {storage.display_url} to {args.out} ({args.format}, {_human(m.total_raw_bytes)})",
    )
    return EXIT_OK


def _reshard(args, storage: Storage, m: Manifest) -> int:
    from ftkit.tools.reshard import reshard

    if args.world_size < 1:
        raise UsageError("--world-size must be at least 1")
    if args.format != "torch":
        raise UsageError("--world-size writes an ftkit checkpoint directory; --format does not apply")
    dst = Storage(args.out, storage_options=json.loads(args.storage_options) if args.storage_options else None)
    try:
        with _progress(m.total_raw_bytes, f"reshard step {m.step}") as update:
            new = reshard(storage, m, dst, args.world_size, progress=update)
    except AlreadyCommitted:
        raise UsageError(f"{dst.display_url} already holds step {m.step}; choose another --out") from None
    _emit(
        args,
        {"step": m.step, "out": dst.display_url, "world_size": new.world_size, "files": len(new.files)},
        f"wrote step {m.step} for {new.world_size} rank(s) to {dst.display_url} "
        f"(from {m.world_size} rank(s), {len(new.files)} file(s))",
    )
    return EXIT_OK


def cmd_gc(args) -> int:
    from ftkit.tools.gc import collect

    if args.url == "ram":
        return _gc_ram(args)
    if args.keep is None:
        raise UsageError("gc needs --keep N (or the URL 'ram' to remove a finished job's RAM tier)")
    if parse_step_dir(args.url.rstrip("/").rsplit("/", 1)[-1]) is not None:
        raise UsageError(f"{args.url} is one step's directory; gc works on the tier above it")
    storage, _ = _open(args)

    bars: list[Any] = []

    def progress(step: int, nbytes: int):  # a bar per step verified, on a terminal
        if not sys.stderr.isatty() or nbytes <= 0:
            return None
        from tqdm import tqdm

        bars.append(tqdm(total=nbytes, desc=f"verify step {step}", unit="B", unit_scale=True, leave=False))
        return bars[-1].update

    try:
        done = collect(storage, args.keep, args.keep_every, args.grace, dry_run=args.dry_run, progress=progress)
    except CheckpointNotFoundError as e:
        raise UsageError(str(e)) from None
    finally:
        for bar in bars:
            bar.close()
    plan = done.plan
    verb = "would remove" if args.dry_run else "removed"
    payload = {
        "url": storage.display_url,
        "dry_run": args.dry_run,
        "kept": list(plan.keep),
        "removed": list(plan.delete),
        "removed_partial": list(plan.remove_partial),
        "held_partial": list(plan.held),
        "refused": list(plan.refused),
        "protected": plan.protected,
        "failed_verification": {str(k): v for k, v in done.failed_verification.items()},
        "aborted_uploads": [u["key"] for u in done.uploads],
        "held_uploads": done.uploads_held,
        "errors": done.errors,
    }
    lines = [
        f"{verb} {len(plan.delete)} step(s) {list(plan.delete)} and {len(plan.remove_partial)} partial "
        f"step(s) {list(plan.remove_partial)}; kept {list(plan.keep)}"
    ]
    if plan.protected is None and plan.keep:
        lines.append("no step verified: every committed step was kept")
    else:
        lines.append(f"newest verified step: {plan.protected}")
    for s, why in sorted(done.failed_verification.items()):
        lines.append(f"step {s} failed verification (kept): {why}")
    if plan.held:
        lines.append(f"left alone (changed less than {args.grace:.0f}s ago; a writer may be live): {list(plan.held)}")
    if plan.refused:
        lines.append(f"refused (a symbolic link, or a manifest that is no regular file): {list(plan.refused)}")
    if done.uploads or done.uploads_held:
        lines.append(
            f"{verb} {len(done.uploads)} incomplete upload(s)"
            + (f"; {done.uploads_held} younger than {args.grace:.0f}s left alone" if done.uploads_held else "")
        )
    lines += [f"error: {e}" for e in done.errors]
    _emit(args, payload, "\n".join(lines))
    return EXIT_FAIL if done.errors else EXIT_OK


def _gc_ram(args) -> int:
    """Remove a finished job's RAM tier (every simulated node's directory) on this machine."""
    from ftkit.tiers.ram import existing_job_dir, job_dir, remove_job

    try:  # a job id is a plain name under the RAM root: never a path (not absolute, no "..")
        path = existing_job_dir(args.job)  # checked as for use: ours, private, not a link
    except (InvalidJobIdError, RunIdentityError) as e:
        raise UsageError(str(e)) from None
    if path is None:
        raise CheckpointNotFoundError(f"no RAM tier for job {args.job or '(default)'} at {job_dir(args.job)}")
    size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(path) for f in fs)
    if not args.dry_run:
        remove_job(args.job)
    _emit(
        args,
        {"removed": path, "bytes": size, "dry_run": args.dry_run},
        f"{'would remove' if args.dry_run else 'removed'} {path} ({_human(size)})",
    )
    return EXIT_OK


def cmd_report(args) -> int:
    from ftkit.tools.report import build, to_html, to_json, to_text

    if not os.path.isdir(os.path.join(args.run_dir, "events")):
        raise CheckpointNotFoundError(f"{args.run_dir}: no events/ directory (is it an ftkit run directory?)")
    try:
        report, events = build(args.run_dir)
    except ValueError:
        raise CheckpointNotFoundError(f"{args.run_dir}: the event log is empty") from None
    if args.html:
        with open(args.html, "w") as f:
            f.write(to_html(report, events, title=f"ftkit run {os.path.basename(os.path.abspath(args.run_dir))}"))
    _emit(args, to_json(report), to_text(report) + (f"\ntimeline written to {args.html}" if args.html else ""))
    return EXIT_OK


# -------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftkit", description="Inspect, verify and restore ftkit checkpoints.")
    p.add_argument("--version", action="version", version=f"ftkit {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_: str, *, json_flag: bool = True, step: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("url", help="tier URL: a local path, file://..., s3://bucket/prefix, any fsspec URL")
        sp.add_argument(
            "--storage-options",
            metavar="JSON",
            help='fsspec storage options, e.g. \'{"client_kwargs": {"endpoint_url": "..."}}\'',
        )
        if step:
            sp.add_argument("--step", type=int, help="a step (default: the newest)")
        if json_flag:
            sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(func=func)
        return sp

    add("ls", cmd_ls, "list the checkpoints at a URL", step=False)
    add("inspect", cmd_inspect, "show one checkpoint's tensors, files and metadata")
    v = add("verify", cmd_verify, "check every chunk's checksum")
    v.add_argument("--all", action="store_true", help="verify every committed step")
    r = add(
        "restore",
        cmd_restore,
        "export a checkpoint to one torch or safetensors file, or reshard it for another world size",
    )
    r.add_argument("--out", required=True, help="output file (with --world-size: a checkpoint directory or URL)")
    r.add_argument("--world-size", type=int, help="write an ftkit checkpoint laid out for this many ranks")
    r.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    r.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    g = add(
        "gc", cmd_gc, "remove old checkpoints and partial steps; 'ftkit gc ram' removes a job's RAM tier", step=False
    )
    g.add_argument("--keep", type=int, help="keep the newest N steps")
    g.add_argument(
        "--job",
        help="with URL 'ram': the run's name, a plain directory name under the RAM root "
        "(default: $FTKIT_RUN_ID, $FTKIT_JOB_ID; unnamed runs are run-<hash>)",
    )
    g.add_argument("--keep-every", type=int, help="also keep every step divisible by M")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    g.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="leave partial steps and incomplete uploads younger than this alone (default 3600)",
    )
    rp = sub.add_parser(
        "report",
        help="goodput, incidents and a timeline from a run's event log",
        description="goodput, incidents and a timeline from a run's event log",
    )
    rp.add_argument("run_dir", help="the run directory ($FTKIT_RUN_DIR of the job)")
    rp.add_argument("--json", action="store_true", help="machine-readable output")
    rp.add_argument("--html", metavar="FILE", help="write a page with the timeline")
    rp.set_defaults(func=cmd_report)
    sub.add_parser("run", help="torchrun with fault-tolerance defaults (ftkit run --help)", add_help=False)
    sub.add_parser(
        "drill",
        help="inject faults into a real torchrun job and prove it recovers (ftkit drill --help)",
        add_help=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        from ftkit.tools.run import cmd_run

        return cmd_run(argv[1:])
    if argv and argv[0] == "drill":
        from ftkit.drill import main as drill_main

        return drill_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if getattr(args, "keep", 1) is not None and getattr(args, "keep", 1) < 1:
        parser.error("--keep must be at least 1")
    try:
        return args.func(args)
    except UsageError as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FtkitError as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return EXIT_FAIL
    except BrokenPipeError:  # `ftkit ls | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print("ftkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
