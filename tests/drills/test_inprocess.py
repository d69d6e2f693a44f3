"""In-process recovery (ftkit.run_in_process) under real torchrun, gloo on CPU.

A rank's exception re-forms the group without a torchrun restart: the surviving
ranks' processes (pids) stay, the generation advances, the state comes back from
node RAM, and the final state equals a fault-free run's bit for bit. A second
fault while the group re-forms ends in a clean torchrun restart, never a hang.
The default drill (tests/drills/test_drill.py) recovers its crash this way too.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import REPO, run_cli, warm_target

from ftkit.coord.events import read_events
from ftkit.coord.faultpoints import FAULT_POINTS_ENV
from ftkit.runtime.warm.zygote import torchrun_command

TRAINER = os.path.join(REPO, "tests", "support", "inprocess_trainer.py")


def torchrun(zygote, out, *args, env=None, restarts=0, timeout=120):
    os.makedirs(out, exist_ok=True)
    full_env = {
        **os.environ,
        "FTKIT_RAM_DIR": str(out / "shm"),
        "FTKIT_JOB_ID": "inproc",
        "FTKIT_RUN_DIR": str(out / "run"),
        "OMP_NUM_THREADS": "1",
        **zygote.env(),
        **(env or {}),
    }
    cmd = torchrun_command(
        zygote,
        [
            "--standalone",
            "--nproc-per-node=2",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            *warm_target(zygote, [TRAINER, "--out", str(out), *args]),
        ],
    )
    r = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    return r, calls


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Steps per run: DDP's fault-free run is shared with the straggler test, which needs ~20 slow
# steps before its verdict; FSDP2's steps cost more.
STEPS = {"ddp": 60, "fsdp": 12}
# Where every rank resumes after a fault at step 6 (before its snapshot): step 5, or 4 or 3 if their
# persists were still running when the group ended. Two staging slots: at most two steps lost.
RESUMED = ({5}, {4}, {3})


@pytest.fixture(scope="module")
def clean_final(tmp_path_factory, zygote):
    """The final state of a fault-free run, by (parallel, steps); each run once per module."""
    finals: dict[tuple[str, int], dict] = {}

    def get(parallel: str, steps: int, *extra: str) -> dict:
        key = (parallel, steps, *extra)
        if key not in finals:
            out = tmp_path_factory.mktemp(f"clean-{parallel}-{steps}")
            r, _ = torchrun(zygote, out, "--parallel", parallel, "--steps", str(steps), *extra)
            assert r.returncode == 0, r.stderr[-3000:]
            finals[key] = torch.load(out / "final.pt", map_location="cpu", weights_only=True)
        return finals[key]

    return get


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_an_exception_on_one_rank_is_recovered_in_process(tmp_path, parallel, zygote, clean_final):
    steps = ("--steps", str(STEPS[parallel]))
    r, calls = torchrun(zygote, tmp_path / "faulted", "--parallel", parallel, *steps, "--crash", "1:6")
    assert r.returncode == 0, r.stderr[-3000:]
    by_gen = {g: {c["rank"]: c for c in calls if c["gen"] == g} for g in (0, 1)}
    assert sorted(c["gen"] for c in calls) == [0, 0, 1, 1]  # one recovery, no torchrun restart
    # the same processes went on: every rank's pid is the one it had
    assert {r: c["pid"] for r, c in by_gen[0].items()} == {r: c["pid"] for r, c in by_gen[1].items()}
    assert all(c["restored"] == 0 for c in by_gen[0].values())
    restored = {c["restored"] for c in by_gen[1].values()}
    assert restored in RESUMED
    assert "injected failure on rank 1" in by_gen[1][1]["reason"]
    # rank 0 was waiting for it in a collective (its connections were shut), or heard the verdict first
    assert any(why in by_gen[1][0]["reason"] for why in ("Connection closed by peer", "RecoveryRequested: rank 1"))
    events = read_events(str(tmp_path / "faulted" / "run"))
    assert {e.get("attempt") for e in events} == {0} and {e.get("gen", 0) for e in events} == {0, 1}
    restores = [e for e in events if e["event"] == "restore" and e.get("gen") == 1]
    assert len(restores) == 2 and all(e["step"] in restored and e["source"] == "ram" for e in restores)
    faulted = torch.load(tmp_path / "faulted" / "final.pt", weights_only=True)
    assert equal(clean_final(parallel, STEPS[parallel]), faulted)
    # ftkit report sees an in-process incident and its breakdown
    rep = run_cli("report", str(tmp_path / "faulted" / "run"), "--json")
    (inc,) = json.loads(rep.stdout)["incidents"]
    assert inc["in_process"] and inc["attempt"] == 0 and inc["gen"] == 0 and {inc["resumed_from"]} == restored
    assert list(inc["phases"]) == ["unwind", "group teardown", "regroup", "group and model", "restore", "first step"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel, fault", [("ddp", "--kill"), ("ddp", "--stop"), ("fsdp", "--kill")])
def test_a_killed_rank_is_replaced_and_the_survivors_keep_their_processes(
    tmp_path, zygote, clean_final, parallel, fault
):
    """ftkit run --replace-dead: rank 1 is SIGKILLed at step 6 (or SIGSTOPped: its node's judge sees it
    stopped and kills it); its warm client asks the zygote for a new worker instead of ending, so
    torchrun (no restarts allowed here) never sees a death; rank 0 recovers in process, and the new
    rank 1 joins its next generation and restores from RAM."""
    steps = ("--steps", str(STEPS[parallel]))
    env = {"FTKIT_REPLACE_DEAD": "1"}
    r, calls = torchrun(zygote, tmp_path / "faulted", "--parallel", parallel, *steps, fault, "1:6", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "starting replacement 1 of 1" in r.stderr
    by_gen = {g: {c["rank"]: c for c in calls if c["gen"] == g} for g in (0, 1)}
    assert sorted(c["gen"] for c in calls) == [0, 0, 1, 1]  # one recovery, no torchrun restart
    assert by_gen[1][0]["pid"] == by_gen[0][0]["pid"]  # the survivor kept its process
    assert by_gen[1][1]["pid"] != by_gen[0][1]["pid"]  # the killed rank is a new one
    assert "replaced rank 1" in by_gen[1][1]["reason"]
    restored = {c["restored"] for c in by_gen[1].values()}
    assert restored in RESUMED
    events = read_events(str(tmp_path / "faulted" / "run"))
    assert {e.get("attempt") for e in events} == {0}
    faulted = torch.load(tmp_path / "faulted" / "final.pt", weights_only=True)
    assert equal(clean_final(parallel, STEPS[parallel]), faulted)


@pytest.mark.timeout(240)
def test_a_second_fault_while_the_group_re_forms_ends_in_a_torchrun_restart(tmp_path, zygote):
    out = tmp_path / "twice"
    os.makedirs(out)
    request = out / "fault-request"  # rank 0 raises inside the recovery, before the group re-forms
    request.write_text(json.dumps({"phase": "recover", "step": 1, "rank": 0, "action": "crash"}))
    r, calls = torchrun(zygote, out, "--crash", "1:6", env={FAULT_POINTS_ENV: str(request)}, restarts=1)
    assert r.returncode == 0, r.stderr[-3000:]
    events = read_events(str(out / "run"))
    starts = sorted((e["attempt"], e.get("gen", 0), e["rank"]) for e in events if e["event"] == "start")
    assert starts == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]  # generation 1 never formed: torchrun restarted
    assert {c["restored"] for c in calls if c["gen"] == 0 and c["restored"]} in RESUMED  # attempt 1, from node RAM
    assert (out / "final.pt").exists()


@pytest.mark.timeout(240)
def test_a_straggler_abort_is_recovered_in_process(tmp_path, zygote, clean_final):
    # Rank 1 is 0.15 s slower a step from step 4 of generation 0, and stragglers are aborted: the
    # verdict (not an exception) re-forms the group in process, and generation 1 runs at full speed.
    r, calls = torchrun(zygote, tmp_path / "faulted", "--steps", str(STEPS["ddp"]), "--slow", "1:4:0.15")
    assert r.returncode == 0, r.stderr[-3000:]
    by_gen = {g: {c["rank"]: c for c in calls if c["gen"] == g} for g in (0, 1)}
    assert sorted(c["gen"] for c in calls) == [0, 0, 1, 1]  # one recovery, no torchrun restart
    assert {r: c["pid"] for r, c in by_gen[0].items()} == {r: c["pid"] for r, c in by_gen[1].items()}
    # the verdict reached a rank at its next snapshot, or its peer's teardown ended its collective first
    assert any("rank 1 straggler" in c["reason"] for c in by_gen[1].values())
    restored = {c["restored"] for c in by_gen[1].values()}
    assert len(restored) == 1 and restored.pop() >= 4
    events = read_events(str(tmp_path / "faulted" / "run"))
    assert {e["target"] for e in events if e["event"] == "straggler"} == {1}
    aborts = [e for e in events if e["event"] == "abort"]
    assert aborts and all(e.get("in_process") for e in aborts)
    assert {e.get("attempt") for e in events} == {0}
    faulted = torch.load(tmp_path / "faulted" / "final.pt", weights_only=True)
    assert equal(clean_final("ddp", STEPS["ddp"]), faulted)


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "backend,gpus",
    [("gloo", 1), ("nccl", 2)],
    ids=["cuda-gloo", "cuda-nccl"],  # NCCL cannot put two ranks on one GPU
)
def test_in_process_recovery_on_cuda_keeps_the_context(tmp_path, zygote, backend, gpus):
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s), this machine has {GPUS} (scripts/gpu-check.sh runs it)")
    cuda = ("--device", "cuda", "--backend", backend)
    r, _ = torchrun(zygote, tmp_path / "clean", *cuda)
    assert r.returncode == 0, r.stderr[-3000:]
    r, calls = torchrun(zygote, tmp_path / "faulted", *cuda, "--crash", "1:6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(c["gen"] for c in calls) == [0, 0, 1, 1]  # one recovery, no torchrun restart
    by_gen = {g: {c["rank"]: c for c in calls if c["gen"] == g} for g in (0, 1)}
    for rank in (0, 1):
        # the same process, and the same CUDA tensor at the same address: the context was kept
        assert by_gen[0][rank]["pid"] == by_gen[1][rank]["pid"]
        assert by_gen[0][rank]["anchor"] == by_gen[1][rank]["anchor"] and by_gen[1][rank]["anchor"][1] == [0, 1, 2, 3]
    assert {c["restored"] for c in by_gen[1].values()} in RESUMED
    clean = torch.load(tmp_path / "clean" / "final.pt", map_location="cpu", weights_only=True)
    faulted = torch.load(tmp_path / "faulted" / "final.pt", map_location="cpu", weights_only=True)
    assert equal(clean, faulted)
