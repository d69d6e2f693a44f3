"""What a drill proves: each fault matched to its detection and recovery, and nothing lost.

Pure functions over what the run left behind: event logs, final states, checkpoints.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ftkit.drill.schedule import OBJECT_STORE_KINDS, STORAGE_KINDS, Fault
from ftkit.tools.report import Report, epoch


def check_faults(
    faults: list[Fault], report: Report | None, events: list[dict[str, Any]], max_lost: int, errors: list[str]
) -> None:
    """Fill each fault's outcome; append a line to `errors` for each one not survived."""
    incidents = {(i.attempt, i.gen): i for i in (report.incidents if report else [])}
    stragglers = report.stragglers if report else []
    final_step = report.final_step if report else 0
    for n, f in enumerate(faults):
        # Effects are counted up to the next fault's injection, so they are not double counted.
        until = next((g.injected_t for g in faults[n + 1 :] if g.injected_t), float("inf"))
        if f.restarts and f.outcome.get("finished_before_stop"):
            continue
        if f.restarts:
            inc = incidents.get((f.attempt, f.gen or 0)) if f.attempt is not None else None
            if inc is None:
                errors.append(f"{f.label()}: no recovery followed")
                continue
            f.outcome = {
                "detected_by": inc.detected_by,
                "detect_s": inc.detect_s,
                "restart_s": inc.restart_s,
                "restore_s": inc.restore_s,
                "recompute_s": inc.recompute_s,
                "recovery_s": inc.total_s,
                "resumed_from": inc.resumed_from,
                "reached": inc.last_step,
                "steps_lost": inc.steps_lost,
                "restored_from": inc.restore_source,
                "in_process": inc.in_process,
                "phases": inc.phases,
            }
            # A fault inside the persist pipeline, or before the last snapshot committed (the pipeline
            # can lag a step), may cost the snapshot in flight; a term costs nothing: the ranks save.
            in_flight = f.during != "step" or snapshot_in_flight(events, f)
            f.outcome["snapshot_in_flight"] = in_flight
            allowed = 0 if f.kind == "term" else max_lost + in_flight
            if inc.steps_lost > allowed:
                errors.append(
                    f"{f.label()}: {inc.steps_lost} step(s) lost (resumed at step {inc.resumed_from} "
                    f"of {inc.last_step}; at most {allowed} allowed)"
                )
            if f.kind == "hang" and not (inc.detected_by or "").startswith("ftkit watchdog"):
                errors.append(f"{f.label()}: the hang was not detected by the watchdog ({inc.detected_by})")
        elif f.kind == "slow":
            f.outcome = {"straggler_reported": any(s["rank"] == f.rank for s in stragglers)}
            if not f.outcome["straggler_reported"]:
                errors.append(f"{f.label()}: the slow rank was not reported as a straggler")
        elif f.kind in STORAGE_KINDS + OBJECT_STORE_KINDS:
            t0 = f.injected_t or 0.0
            durable = [e for e in events if e["event"] == "persist" and not str(e.get("tier", "")).startswith("ram")]
            failed = [e for e in durable if not e.get("ok", True) and t0 <= e["t"] < until]
            later = [e for e in durable if e.get("ok") and e.get("committed_by_me") and e["t"] >= t0 + f.seconds]
            slowest = max(
                (e.get("seconds") or 0.0 for e in durable if e.get("ok") and t0 <= e["t"] < until), default=0.0
            )
            f.outcome = {
                "failed_persists": len(failed),
                "slowest_persist_s": slowest,
                "training_continued": final_step > (f.injected_step or 0),
                "committed_after": min((e["step"] for e in later), default=None),
            }
            if not f.outcome["training_continued"]:
                errors.append(f"{f.label()}: training did not go on")
            # (An S3 outage may also be waited out: the client retries until the server is back.)
            if f.kind in ("enospc", "unavailable") and f.seconds > 0 and not failed:
                errors.append(f"{f.label()}: no persist failed while the storage was down")
            if f.outcome["committed_after"] is None and final_step >= (f.injected_step or 0) + 2:
                errors.append(f"{f.label()}: no step was committed to the durable tier after the fault")


def snapshot_in_flight(events: list[dict[str, Any]], fault: Fault) -> bool:
    """Whether the step before the fault's had not committed on any tier when it struck (the
    pipeline lagged: a fault "during step" strikes before its own step's snapshot)."""
    if fault.injected_t is None or fault.injected_step is None:
        return False
    committed = max(
        (
            e["step"]
            for e in events
            if e["event"] == "persist"
            and e.get("ok")
            and e.get("committed_by_me")
            and epoch(e) == (fault.attempt, fault.gen or 0)
            and e["t"] <= fault.injected_t
        ),
        default=0,
    )
    return committed < fault.injected_step - 1


def consumed_stream(events: list[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """The batches the final state was trained on: (step, rank, digest), from "batch" events. Of an
    attempt followed by one that restored step R, only the batches up to R count."""
    attempts = sorted({epoch(e) for e in events if e["event"] == "batch"})  # attempts and generations
    resumed = {
        a: max((e.get("step") or 0 for e in events if e["event"] == "restore" and epoch(e) == a), default=0)
        for a in attempts
    }
    out = []
    for n, a in enumerate(attempts):
        cutoff = resumed[attempts[n + 1]] if n + 1 < len(attempts) else float("inf")
        out += [
            (e["step"], e["rank"], e["digest"])
            for e in events
            if e["event"] == "batch" and epoch(e) == a and e["step"] <= cutoff
        ]
    return sorted(out)


def compare_streams(faulted: list, clean: list, errors: list[str]) -> bool:
    """Every (step, rank) batch of the fault-free run consumed once, none skipped, none repeated."""
    faulted, clean = [tuple(x) for x in faulted], [tuple(x) for x in clean]
    if faulted == clean:
        return True
    seen = Counter((step, rank) for step, rank, _ in faulted)
    repeated = sorted(k for k, n in seen.items() if n > 1)
    missing = sorted({(s, r) for s, r, _ in clean} - set(seen))
    other = sorted({(s, r) for s, r, d in set(faulted) - set(clean)} - set(repeated))
    errors.append(
        f"the consumed sample stream differs from the fault-free run: {len(missing)} batch(es) skipped "
        f"{missing[:3]}, {len(repeated)} repeated {repeated[:3]}, {len(other)} different {other[:3]} "
        "((step, rank) pairs)"
    )
    return False


def load_final(path: str) -> dict[str, Any]:
    """A run's final model and optimizer state (reference.py --final-out): ValueError if it is cut
    short or garbled (an OSError if it cannot be read at all)."""
    import torch

    try:
        state = torch.load(path, weights_only=True)
    except OSError:
        raise  # (cannot be read at all: the caller's)
    except Exception as e:  # cut short or garbled: torch says so as EOFError, RuntimeError or an unpickling error
        raise ValueError(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'cut short'}") from None
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict) and isinstance(state.get("optim"), dict)):
        raise ValueError(f"{path}: not a model and optimizer state")
    return state


def compare_states(faulted_pt: str, clean_pt: str, errors: list[str]) -> bool:
    """The faulted run's final model and optimizer state equal the fault-free run's, bit for bit."""
    import torch

    try:
        a = load_final(faulted_pt)
        b = load_final(clean_pt)
    except (OSError, ValueError) as e:
        errors.append(f"no final state to compare ({type(e).__name__}: {e})")
        return False
    diff = [k for k, v in b["model"].items() if k not in a["model"] or not torch.equal(a["model"][k], v)]
    for p, st in b["optim"]["state"].items():
        diff += [
            f"optim.state.{p}.{k}"
            for k, v in st.items()
            if k not in a["optim"]["state"].get(p, {}) or not torch.equal(a["optim"]["state"][p][k], v)
        ]
    if diff:
        errors.append(f"final state differs from the fault-free run in {len(diff)} tensor(s), e.g. {diff[0]}")
    return not diff


def verify_checkpoints(events: list[dict[str, Any]], errors: list[str]) -> dict[str, Any]:
    """A user's script: the newest committed step of every durable tier it used verifies."""
    from ftkit.errors import FtkitError
    from ftkit.format.data import verify
    from ftkit.format.reader import committed_steps, load_manifest
    from ftkit.tiers.storage import Storage

    urls = sorted({u for e in events if e["event"] == "start" for u in e.get("tiers", []) if u not in ("ram", "peer")})
    out: dict[str, Any] = {}
    for url in urls:
        try:
            storage = Storage(url)
            steps = committed_steps(storage)
            if not steps:
                raise FtkitError(f"no committed step in {storage.display_url}")
            verify(storage, load_manifest(storage, steps[-1]))
            out[url] = steps[-1]
        except (FtkitError, OSError) as e:
            errors.append(f"the final checkpoint does not verify: {e}")
            out[url] = None
    if not urls:
        errors.append("the script used no durable tier: nothing to verify")
    return out
