"""`ftkit drill`: run a job, break it on a schedule, prove it recovered with nothing lost.

run_drill: parse the schedule and tiers; start the drill's S3 server for ``s3``; the fault-free
reference (built-in trainer only, maybe cached); the faulted run, waiting for each restart before
the next fault; verify (verify.py); write the reports. "passed" only if everything held.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ftkit.coord.events import read_events
from ftkit.drill.job import Injector, Job
from ftkit.drill.schedule import OBJECT_STORE_KINDS, STORAGE_KINDS, Fault, parse_faults, random_faults
from ftkit.drill.verify import (
    check_faults,
    compare_states,
    compare_streams,
    consumed_stream,
    load_final,
    verify_checkpoints,
)
from ftkit.runtime.warm.client import REPLACE_ENV
from ftkit.runtime.warm.zygote import Zygote
from ftkit.runtime.warm.zygote import start as start_zygote
from ftkit.tools.report import analyze, to_html

DEFAULT_FAULTS = "kill@70:rank=1,hang@160:rank=2,node@250:node=1,crash@340:rank=3"
DEFAULT_TIERS = "ram,peer,disk"


@dataclass(frozen=True)
class TierPlan:
    """What the built-in trainer snapshots to: RAM, peer replicas, one durable tier."""

    ram: bool
    replicas: int
    durable: str  # "disk", "s3" (the drill's own server) or a URL
    spec: str

    @staticmethod
    def parse(spec: str) -> TierPlan:
        ram, replicas, durable = False, 0, []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if item == "ram":
                ram = True
            elif item == "peer" or item.startswith("peer="):
                _, _, k = item.partition("=")
                if k and not (k.isascii() and k.isdigit()):  # (int() refuses "²")
                    raise ValueError(f"--tiers: bad replica count in {item!r} (peer=K)")
                replicas = int(k or 1)
            elif item in ("disk", "s3") or "://" in item:
                durable.append(item)
            else:
                raise ValueError(f"--tiers: unknown tier {item!r} (ram, peer[=K], disk, s3, or a URL)")
        if len(durable) != 1:
            raise ValueError("--tiers: name exactly one durable tier (disk, s3, or a URL)")
        if replicas and not ram:
            raise ValueError('--tiers: "peer" replicates the RAM tier: add "ram"')
        return TierPlan(ram, replicas, durable[0], spec)

    def durable_url(self, root: str, s3: Any) -> tuple[str, str | None]:
        """The durable tier's URL, and the local directory behind it when storage faults can be injected."""
        if self.durable == "disk":
            path = os.path.join(root, "ckpt")
            return "faulty://" + path, path
        if self.durable == "s3":
            return s3.url(f"drill-{uuid.uuid4().hex[:8]}/ckpt"), None
        if self.durable.startswith("faulty://"):
            return self.durable, self.durable[len("faulty://") :]
        return self.durable, None


def _check_schedule(faults: list[Fault], tiers: TierPlan | None, steps: int, every: int) -> None:
    if faults and faults[-1].step >= steps - 2:
        raise ValueError(f"the last fault must come before step {steps - 2} (--steps {steps})")
    for f in faults:
        if tiers is None:  # a user's script
            if f.kind in STORAGE_KINDS + OBJECT_STORE_KINDS:
                raise ValueError(
                    f"{f.label()}: storage faults need the built-in trainer "
                    "(its durable tier is behind the drill's faulty:// filesystem)"
                )
            continue
        if f.kind in STORAGE_KINDS and not (tiers.durable == "disk" or tiers.durable.startswith("faulty://")):
            raise ValueError(
                f"{f.label()}: storage faults need the durable tier behind faulty:// "
                f"(--tiers ...,disk), not {tiers.durable}"
            )
        if f.kind in OBJECT_STORE_KINDS and tiers.durable != "s3":
            raise ValueError(f"{f.label()}: an S3 outage needs the drill's own S3 server (--tiers ...,s3)")
        if f.during == "replicate" and not tiers.replicas:
            raise ValueError(f"{f.label()}: no replication without RAM-tier replicas (peer)")
        # It strikes at the first durable persist at or after its step, which the run must reach. (One
        # at the last step is recovered from, as the run restores that step: no need for steps after it.)
        landing = -(-f.step // every) * every
        if f.during in ("persist", "commit") and landing > steps:
            raise ValueError(
                f"{f.label()}: lands at the first durable persist at or after step {f.step}, step {landing} "
                f"(--every {every}), after the last step {steps} (--steps {steps})"
            )


def _entry(args, tiers: TierPlan, url: str, final_out: str, step_time: float) -> list[str]:
    argv = ["-m", "ftkit.drill.reference", "--ckpt", url, "--every", str(args.every)]
    argv += ["--ram"] if tiers.ram else []
    argv += ["--peer", str(tiers.replicas)] if tiers.replicas else []
    argv += ["--steps", str(args.steps), "--step-time", str(step_time), "--final-out", final_out]
    return argv + ([] if args.no_in_process else ["--in-process"])


def _begin(args, headline: str, faults: list[Fault]) -> tuple[str, str, Callable[..., None]]:
    """(run directory, its faulted/ made afresh, `say`), having said what the drill runs."""
    root = os.path.abspath(args.run_dir or tempfile.mkdtemp(prefix="ftkit-drill-"))
    faulted = os.path.join(root, "faulted")
    shutil.rmtree(faulted, ignore_errors=True)
    os.makedirs(faulted)
    say = (lambda *a, **k: None) if args.quiet else print
    say(headline)
    say(f"drill: faults: {', '.join(f.label() for f in faults) or 'none'}")
    say(f"drill: run directory {root}")
    return root, faulted, say


def fault_free(args, root: str, zygote: Zygote | None, stretches: list[tuple[int, int, int]], every: int):
    """The job without faults, the step-time sleep or the RAM tier (neither changes a value, which
    the bitwise comparison checks too): `stretches` of (world size, ranks per node, step it trains
    from), each a torchrun resuming from the previous one's checkpoint, which it persists every
    `every` steps. Returns (final state path, consumed stream, error)."""
    clean = os.path.join(root, "fault-free")
    shutil.rmtree(clean, ignore_errors=True)
    ckpt, final = os.path.join(clean, "ckpt"), os.path.join(clean, "final.pt")
    stream: list = []
    bounds = [frm for *_, frm in stretches[1:]] + [args.steps]
    for n, ((world, rpn, frm), until) in enumerate(zip(stretches, bounds)):
        seg = os.path.join(clean, f"stretch-{n}")
        os.makedirs(seg)
        seg_args = argparse.Namespace(**{**vars(args), "steps": until, "every": every})
        entry = _entry(seg_args, TierPlan(False, 0, "disk", ""), ckpt, final, 0.0)
        job = Job(seg, entry, world, rpn, restarts=0, zygote=zygote)
        try:
            rc: int | str = job.proc.wait(timeout=300 + until)
        except subprocess.TimeoutExpired:
            rc = "a timeout"
        finally:
            job.kill()
        if rc != 0:
            return None, None, f"the fault-free reference run failed (exit {rc}; see {job.log.name})"
        stream += [s for s in consumed_stream(read_events(job.run_dir)) if frm < s[0] <= until]
    return final, sorted(stream), None


def _reference_run(args, root: str, say, zygote: Zygote | None) -> tuple[str | None, list | None, str | None]:
    """The fault-free run (fault_free), from --reference-cache when it holds one."""
    key = f"n{args.nproc}-r{args.ranks_per_node}-s{args.steps}"
    cached = os.path.join(args.reference_cache, key, "final.pt") if args.reference_cache else None
    if cached and os.path.exists(cached) and os.path.exists(cached + ".stream.json"):
        try:
            stream = _read_cached(cached)
        except (OSError, ValueError) as e:  # a cut or garbled entry is a miss, not the drill's end
            say(f"drill: cannot read the cached fault-free reference ({e}): running it again")
        else:
            say(f"drill: fault-free reference from the cache ({cached})")
            return cached, stream, None
    final, stream, err = fault_free(args, root, zygote, [(args.nproc, args.ranks_per_node, 0)], args.every)
    if cached and final:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        # Each file whole or not at all: a drill killed while writing them leaves no half entry.
        tmp = f"{cached}.{os.getpid()}.tmp"
        shutil.copyfile(final, tmp)
        os.replace(tmp, cached)
        with open(tmp, "w") as f:
            json.dump(stream, f)
        os.replace(tmp, cached + ".stream.json")
    return final, stream, err


def _read_cached(cached: str) -> list:
    """A cached fault-free run's consumed stream, once both its files have been read whole."""
    load_final(cached)
    try:
        with open(cached + ".stream.json") as f:
            stream = json.load(f)
    except ValueError as e:
        raise ValueError(f"{cached}.stream.json: {e}") from None
    if not (isinstance(stream, list) and all(isinstance(x, list) and len(x) == 3 for x in stream)):
        raise ValueError(f"{cached}.stream.json: not a list of [step, rank, digest]")
    return stream


def run_drill(args) -> dict[str, Any]:
    rpn = args.ranks_per_node
    script = args.script
    tiers = None if script else TierPlan.parse(args.tiers or DEFAULT_TIERS)
    if args.seed is not None:
        peer = bool(tiers and tiers.replicas) or bool(script)
        faults = random_faults(args.seed, args.steps, args.nproc, rpn, count=args.count, peer=peer)
    else:
        faults = parse_faults(args.faults, args.nproc, rpn)
    _check_schedule(faults, tiers, args.steps, args.every)
    what = f"script {script}" if script or tiers is None else f"the reference trainer (tiers {tiers.spec})"
    headline = f"drill: {what}, {args.nproc} ranks on {args.nproc // rpn} simulated nodes, {args.steps} steps"
    root, faulted, say = _begin(args, headline, faults)
    errors: list[str] = []
    s3 = None
    clean_pt, clean_stream = None, None
    zygote = None
    try:
        if not args.cold:
            # One zygote for both runs: torchrun's agent and every worker of every attempt are forked from it.
            preload = ("torch.distributed.run", *(m for m in args.preload.split(",") if m))
            zygote = start_zygote(preload=preload if script else ("ftkit.drill.reference", *preload))
        if tiers and tiers.durable == "s3":
            from ftkit.drill.s3server import S3Server

            s3 = S3Server(data_dir=os.path.join(root, "s3")).start()
            say(f"drill: S3 server (SeaweedFS) at {s3.endpoint_url}")
        final_pt = os.path.join(faulted, "final.pt")
        if script:
            entry, durable_root = [script, *args.script_args], None
        else:
            assert tiers is not None  # the reference trainer always has a tier plan
            clean_pt, clean_stream, err = _reference_run(args, root, say, zygote)
            if err:
                errors.append(err)
            url, durable_root = tiers.durable_url(faulted, s3)
            entry = _entry(args, tiers, url, final_pt, args.step_time)
        env = s3.env() if s3 else {}
        if zygote is not None and not args.no_replace:  # a killed worker of an in-process loop is replaced
            env[REPLACE_ENV] = str(sum(f.kind in ("kill", "hang") for f in faults) + 1)
        restarts = sum(f.restarts for f in faults) + 1
        job = Job(faulted, entry, args.nproc, rpn, restarts, env=env, zygote=zygote)
        injector = Injector(job, durable_root, s3)
        try:
            for f in faults:
                attempt = job.attempt()
                injector.inject(f)
                gen = f", generation {attempt[1]}" if attempt[1] else ""
                say(f"  injected {f.label()} at step {f.injected_step} (attempt {attempt[0]}{gen})")
                if f.restarts and not job.wait_restarted(attempt):
                    if f.kind == "term" and job.proc.poll() == 0:
                        f.outcome = {"finished_before_stop": True}  # nothing to resume
                        continue
                    errors.append(f"{f.label()}: no restart followed")
                    break
            limit = 300 + args.steps * (args.step_time + 0.5) + 60 * len(faults)
            try:
                rc = job.proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = None
                errors.append(f"the faulted run did not finish within {limit:.0f}s (see {job.log.name})")
            if rc:
                errors.append(f"the faulted run exited with {rc} (see {job.log.name})")
            injector.join()
            errors += injector.failures
        except RuntimeError as e:
            errors.append(str(e))
        finally:
            job.kill()
    finally:
        if zygote is not None:
            zygote.stop()
        if s3 is not None:
            s3.stop()
    events = job.events()
    report = analyze(events) if events else None
    check_faults(faults, report, events, args.max_lost, errors)
    result: dict[str, Any] = {
        "run_dir": root,
        "target": script or "ftkit.drill.reference",
        "tiers": tiers.spec if tiers else None,
    }
    if script:
        result["checkpoints"] = verify_checkpoints(events, errors)
        result["bitwise_equal"] = None
    else:
        # None: not compared (the fault-free run failed)
        result["bitwise_equal"] = None if clean_pt is None else compare_states(final_pt, clean_pt, errors)
        result["same_sample_stream"] = (
            None if clean_stream is None else compare_streams(consumed_stream(events), clean_stream, errors)
        )
    return _finish(args, result, faults, report, events, errors, "ftkit drill")


def _finish(args, result: dict[str, Any], faults: list[Fault], report, events, errors: list[str], title: str) -> dict:
    """`result` completed with the verdict and the recoveries' figures; written to --json and --html."""
    recovered = [f.outcome for f in faults if f.restarts and "recovery_s" in f.outcome]
    detect = [o["detect_s"] for o in recovered if o["detect_s"] is not None]
    result.update(
        {
            "passed": not errors,
            "errors": errors,
            "goodput": report.goodput if report else 0.0,
            "wall_s": report.wall_s if report else 0.0,
            "final_step": report.final_step if report else 0,
            "attempts": report.attempts if report else 0,
            "mean_detect_s": statistics.mean(detect) if detect else None,
            "mean_recovery_s": statistics.mean(o["recovery_s"] for o in recovered) if recovered else None,
            "steps_lost": sum(o["steps_lost"] for o in recovered),
            "faults": [asdict(f) for f in faults],
        }
    )
    # A file that cannot be written is a problem of the drill, not the loss of its summary. The page
    # first, so that the result written after it says what became of it.
    if args.html and not report:
        _failed(result, f"--html {args.html}: not written (no events: the job logged nothing)")
    elif args.html:
        try:
            with open(args.html, "w") as fh:
                fh.write(to_html(report, events, title=f"{title}: {'PASS' if result['passed'] else 'FAIL'}"))
        except OSError as e:
            _failed(result, f"--html {args.html}: cannot write ({e.strerror or e})")
    if args.json:
        try:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2, default=str)
        except OSError as e:
            _failed(result, f"--json {args.json}: cannot write ({e.strerror or e})")
    return result


def _failed(result: dict[str, Any], error: str) -> None:
    result["errors"].append(error)
    result["passed"] = False
