"""The `ftkit` command line: ls, inspect, verify, restore, export, gc, report, run, drill.

Exit codes: 0 success; 1 a checkpoint is missing, corrupt or unreadable (or storage failed);
2 a usage error. Expected errors print one line, ``ftkit: error: ...``, and no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ftkit import __version__
from ftkit.errors import FtkitError, UsageError
from ftkit.tools import protocol
from ftkit.tools.cliutil import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from ftkit.tools.commands import cmd_inspect, cmd_ls, cmd_report, cmd_restore, cmd_verify
from ftkit.tools.gc import DEFAULT_GRACE_S, cmd_gc


def location(text: str) -> str:
    """A path or URL argument. Empty (an unset shell variable) would mean the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty (an unset variable?): name a directory or URL")
    return text


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds of 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftkit", description="Inspect, verify and restore ftkit checkpoints.")
    p.add_argument("--version", action="version", version=f"ftkit {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_: str, *, step: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument(
            "url", type=location, help="tier URL: a local path, file://..., s3://bucket/prefix, any fsspec URL"
        )
        sp.add_argument(
            "--storage-options",
            metavar="JSON",
            help='fsspec storage options, e.g. \'{"client_kwargs": {"endpoint_url": "..."}}\'',
        )
        if step:
            sp.add_argument("--step", type=int, help="a step (default: the newest)")
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
    r.add_argument(
        "--out", required=True, type=location, help="output file (with --world-size: a checkpoint directory or URL)"
    )
    r.add_argument("--world-size", type=int, help="write an ftkit checkpoint laid out for this many ranks")
    r.add_argument(
        "--format",
        choices=("torch", "safetensors", "dcp"),
        default="torch",
        help="torch: one file of nested dicts; safetensors: the tensors by name; dcp: a DCP checkpoint directory",
    )
    r.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    e = add("export", cmd_restore, "write one step as a torch file, a safetensors file or a DCP checkpoint directory")
    e.add_argument("--out", required=True, type=location, help="output file (--format dcp: a directory)")
    e.add_argument("--format", choices=("torch", "safetensors", "dcp"), default="torch")
    e.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    g = add(
        "gc", cmd_gc, "remove old checkpoints and partial steps; 'ftkit gc ram' removes a job's RAM tier", step=False
    )
    g.add_argument("--keep", type=int, help="keep the newest N steps")
    g.add_argument(
        "--job",
        help="with URL 'ram': the run's name, a plain directory name under the RAM root "
        "(default: $FTKIT_RUN_ID, $FTKIT_JOB_ID; unnamed runs are run-<hash>)",
    )
    g.add_argument(
        "--force", action="store_true", help="with URL 'ram': remove it even while a running job on this node uses it"
    )
    g.add_argument("--keep-every", type=int, help="also keep every step divisible by M")
    g.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    g.add_argument(
        "--grace",
        type=_seconds,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="leave partial steps and incomplete uploads younger than this alone (default 3600)",
    )
    help_ = "goodput, incidents and a timeline from a run's event log"
    rp = sub.add_parser("report", help=help_, description=help_)
    rp.add_argument("run_dir", type=location, help="the run directory ($FTKIT_RUN_DIR of the job)")
    rp.add_argument("--json", action="store_true", help="machine-readable output")
    rp.add_argument("--html", metavar="FILE", help="write a page with the timeline")
    rp.set_defaults(func=cmd_report)
    protocol.add_parser(sub)
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
        from ftkit.runtime.run import cmd_run

        return cmd_run(argv[1:])
    if argv and argv[0] == "drill":
        from ftkit.drill import main as drill_main

        return drill_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if getattr(args, "keep", None) is not None and args.keep < 1:
        parser.error("--keep must be at least 1")
    if getattr(args, "keep_every", None) is not None and args.keep_every < 1:
        parser.error("--keep-every must be at least 1")
    try:
        return args.func(args)
    except FtkitError as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, UsageError) else EXIT_FAIL
    except BrokenPipeError:  # `ftkit ls | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print("ftkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
