"""`ftkit drill`'s command line: the arguments, the run (run.py), the summary printed.

Exit codes: 0 the drill passed, 1 it failed (or could not run: a server, a file),
2 the arguments or the schedule are wrong.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from ftkit.drill import schedule
from ftkit.drill.hostdrill import DEFAULT_HOST_FAULTS, run_host_drill
from ftkit.drill.hosts import exit_on_stop_signals
from ftkit.drill.run import DEFAULT_FAULTS, DEFAULT_TIERS, run_drill
from ftkit.drill.schedule import OBJECT_STORE_KINDS, STORAGE_KINDS, Fault
from ftkit.errors import UsageError
from ftkit.tools.report import phases_text


def print_summary(result: dict[str, Any]) -> None:
    print()
    for f in result["faults"]:
        o = f["outcome"]
        fault = Fault(**{k: f.get(k) for k in ("kind", "step", "rank", "node", "during", "host")})
        label = f"{fault.kind}@{f['injected_step'] or f['step']} {fault.where()}" + (
            "" if fault.during == "step" else f" ({fault.during})"
        )
        if f["kind"] == "slow":
            print(f"  {label:<28} straggler reported: {o.get('straggler_reported')}")
        elif f["kind"] in STORAGE_KINDS + OBJECT_STORE_KINDS:
            print(
                f"  {label:<28} {o.get('failed_persists')} persist(s) failed; training went on: "
                f"{o.get('training_continued')}; next commit after it: step {o.get('committed_after')}"
            )
        elif o.get("finished_before_stop"):
            print(f"  {label:<28} the run reached its last step before the agreed stop: nothing to resume")
        elif "recovery_s" in o:
            det = f"{o['detect_s']:.1f}s" if o["detect_s"] is not None else "at once"
            print(
                f"  {label:<28} detected by {o['detected_by']} ({det}); recovered in {o['recovery_s']:.1f}s "
                f"(restart {o['restart_s']:.1f}s, restore {o['restore_s']:.2f}s from {o['restored_from']}, "
                f"recompute {o['recompute_s']:.1f}s); resumed at step {o['resumed_from']} of "
                f"{o['reached']}, {o['steps_lost']} step(s) recomputed"
            )
            if o.get("phases"):
                print(f"  {'':<28} {phases_text(o['phases'])} s")
        else:
            print(f"  {label:<28} NOT RECOVERED")
    md, mr = result["mean_detect_s"], result["mean_recovery_s"]
    print(
        f"\n  final step {result['final_step']}; goodput {result['goodput']:.1%} over {result['wall_s']:.1f}s; "
        f"mean detection {'-' if md is None else f'{md:.1f}s'}, mean recovery "
        f"{'-' if mr is None else f'{mr:.1f}s'}, {result['steps_lost']} step(s) recomputed in all"
    )
    if "same_sample_stream" in result:  # the built-in trainer's drill (a script's has no fault-free run)
        if result["bitwise_equal"] is None:  # the fault-free run failed (a problem below)
            print("  final model and optimizer state and consumed sample stream not compared (no fault-free run)")
        else:
            print(
                f"  final model and optimizer state {'EQUAL' if result['bitwise_equal'] else 'DIFFERENT'} "
                f"to the fault-free run, bit for bit; consumed sample stream "
                f"{'IDENTICAL' if result.get('same_sample_stream') else 'DIFFERENT'}"
            )
    for url, step in (result.get("checkpoints") or {}).items():
        print(f"  final checkpoint in {url}: " + (f"step {step} verifies" if step is not None else "DOES NOT VERIFY"))
    for e in result["errors"]:
        print(f"  problem: {e}")
    print(f"\ndrill {'PASSED' if result['passed'] else 'FAILED'}  (run directory {result['run_dir']})")


def _unwritable(path: str, run_dir: str | None) -> str | None:
    """Why a file cannot be written at `path`, or None (its directory may be --run-dir, or above it:
    the drill makes those first)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not path:
        return "an empty path (an unset shell variable?)"
    if os.path.isdir(path):
        return "is a directory"
    if run_dir and (os.path.abspath(run_dir) + os.sep).startswith(parent + os.sep):
        return None
    if not os.path.isdir(parent):
        return f"no such directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"directory {parent} is not writable"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ftkit drill",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inject faults into a real torchrun job and prove it recovers with nothing lost.",
        epilog=schedule.__doc__,
    )
    # (None until main(): --hosts refuses them given, not their defaults)
    p.add_argument("--nproc", type=int, help="ranks (default 4)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per simulated node (default 2)")
    p.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    p.add_argument(
        "--step-time",
        type=float,
        default=0.25,
        help="seconds each step waits, standing for accelerator time (default 0.25)",
    )
    p.add_argument("--every", type=int, default=10, help="durable tier every N steps (default 10)")
    p.add_argument(
        "--faults",
        help=f"the schedule (default {DEFAULT_FAULTS!r}; with --hosts {DEFAULT_HOST_FAULTS!r})",
    )
    p.add_argument("--seed", type=int, help="a random schedule from this seed instead of --faults")
    p.add_argument("--count", type=int, default=3, help="faults in a --seed schedule (default 3)")
    p.add_argument(
        "--tiers",
        help=f"built-in trainer's tiers: ram, peer[=K], and one of disk, s3 (an S3 "
        f"server the drill runs), or a URL (default {DEFAULT_TIERS})",
    )
    p.add_argument("--no-peer", action="store_true", help="shorthand for --tiers ram,disk")
    p.add_argument(
        "--script",
        help="drill this training script (it uses ftkit) instead of the built-in trainer; its arguments go after --",
    )
    p.add_argument("--run-dir", help="where to keep everything (default: a new temporary directory)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--html", help="write a page with the timeline here")
    p.add_argument(
        "--max-lost",
        type=int,
        default=1,
        help="steps a fault between steps may cost (default 1; one more inside the persist pipeline)",
    )
    p.add_argument("--reference-cache", help="reuse fault-free runs kept in this directory")
    p.add_argument(
        "--cold",
        action="store_true",
        help="start every worker as a new interpreter (no zygote; how restarts cost before warm starts)",
    )
    p.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="more modules the zygote imports before forking workers, comma-separated "
        "(as `ftkit run --preload`; e.g. lightning.pytorch for a Lightning script)",
    )
    p.add_argument(
        "--no-in-process",
        action="store_true",
        help="the built-in trainer recovers from a crash through torchrun, not in process",
    )
    p.add_argument(
        "--no-replace",
        action="store_true",
        help="a killed or hung rank restarts the group through torchrun (warm), instead of being "
        "replaced while the others recover in process (as ftkit run --replace-dead)",
    )
    hosts = p.add_argument_group("over emulated hosts (Linux namespaces; needs root)")
    hosts.add_argument(
        "--hosts",
        type=int,
        help="run over N emulated hosts, one torchrun agent each (host, partition and agent faults)",
    )
    hosts.add_argument("--spare-hosts", type=int, default=0, help="hosts that wait to replace a lost one (default 0)")
    hosts.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (default 2)")
    hosts.add_argument(
        "--rdzv",
        choices=("etcd", "c10d"),
        default="etcd",
        help="the agents' rendezvous: etcd on a host of its own (default), or c10d on the first host",
    )
    p.add_argument("--quiet", action="store_true")
    return p


def _main_hosts(p: argparse.ArgumentParser, args: Any) -> int:
    """`ftkit drill --hosts N`: the drill over emulated hosts (hostdrill.py)."""
    if args.hosts < 2 or args.ranks_per_host < 1 or args.spare_hosts < 0:
        p.error("--hosts must be at least 2, --ranks-per-host at least 1, --spare-hosts at least 0")
    if args.script or args.preload or args.seed is not None:  # (its zygotes preload the built-in trainer's modules)
        p.error("--hosts drills the built-in trainer on a --faults schedule: no script, --preload or --seed")
    if args.no_peer:
        args.tiers = args.tiers or "ram,disk"
    ignored = [f"--{o}" for o in ("nproc", "ranks-per-node", "reference-cache") if getattr(args, o.replace("-", "_"))]
    if ignored:  # (it ran with --hosts x --ranks-per-host ranks, and its own fault-free run)
        p.error(f"--hosts takes its ranks from --hosts and --ranks-per-host: no {', '.join(ignored)}")
    if args.faults is None and args.hosts + args.spare_hosts < 3:  # (the one host left, cut off, restarts nothing)
        p.error(f"the default schedule ({DEFAULT_HOST_FAULTS}) needs 3 hosts, or 2 and a spare: give --faults")
    args.faults = DEFAULT_HOST_FAULTS if args.faults is None else args.faults
    return _run(run_host_drill, args)


def _run(drill: Callable[[Any], dict[str, Any]], args: Any) -> int:
    """Run the drill and print its summary: 0 passed, 1 failed or broke, 2 misused."""
    # SIGTERM and SIGHUP raise SystemExit, so that the drill's `finally`s stop its zygote (its own
    # session: nothing else would end it), S3 server, job and hosts.
    changed = exit_on_stop_signals()
    try:
        result = drill(args)
    except (UsageError, ValueError, RuntimeError, OSError) as e:
        print(f"ftkit: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (UsageError, ValueError)) else 1
    except KeyboardInterrupt:  # (Ctrl-C: the drill's `finally`s have cleaned up on the way out)
        print("ftkit: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig in changed:
            signal.signal(sig, signal.SIG_DFL)
    if not args.quiet:
        print_summary(result)
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    p = build_parser()
    args = p.parse_args(argv)
    args.script_args = script_args
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be at least 1")
    if not (math.isfinite(args.step_time) and args.step_time >= 0):  # (NaN passes a '< 0' test)
        p.error(f"--step-time must be a finite number of seconds >= 0, not {args.step_time}")
    if args.max_lost < 0:
        p.error("--max-lost must be at least 0")
    for opt, path in (("--json", args.json), ("--html", args.html)):
        # Checked now: they are written at the very end, and a bad one would throw the whole drill away.
        if path is not None and (why := _unwritable(path, args.run_dir)):
            p.error(f"{opt} {path!r}: {why}")
    if args.hosts is not None:
        return _main_hosts(p, args)
    args.faults = DEFAULT_FAULTS if args.faults is None else args.faults
    args.nproc = 4 if args.nproc is None else args.nproc
    args.ranks_per_node = 2 if args.ranks_per_node is None else args.ranks_per_node
    if args.ranks_per_node < 1 or args.nproc < 2 or args.nproc % args.ranks_per_node:
        p.error("--nproc must be at least 2 and a multiple of --ranks-per-node (at least 1)")
    if args.no_peer:
        if args.tiers:
            p.error("--no-peer and --tiers: name the tiers once")
        args.tiers = "ram,disk"
    if args.script:
        if args.tiers:
            p.error("--tiers applies to the built-in trainer; a script chooses its own tiers")
        if not os.path.isfile(args.script):
            print(f"ftkit: error: no such script: {args.script}", file=sys.stderr)
            return 2
        args.script = os.path.abspath(args.script)
    return _run(run_drill, args)
