"""The trainer integrations with several processes: Lightning and the Hugging Face
Trainer with DDP and FSDP2 under torchrun.

Real Lightning and transformers, real torchrun (its elastic agent restarts the job after
a SIGKILL), real gloo ranks, real ftkit tiers. Each run writes what every step of every
rank consumed (tests/support/lightning_ddp_job.py, tests/support/huggingface_ddp_job.py); a killed and
resumed run is compared with an uninterrupted one: the sample stream step by step, and
the final weights and optimizer state bit for bit (DDP's gloo all-reduce of two ranks
sums in a fixed order). Workers fork from a zygote with both frameworks imported, as
`ftkit run --preload` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_cli, warm_target
from drillkit import by_kind, drill

import ftkit
from ftkit.format.reader import committed_steps, newest_manifest
from ftkit.runtime.warm.zygote import torchrun_command

JOB = os.path.join(REPO, "tests", "support", "lightning_ddp_job.py")
HF_JOB = os.path.join(REPO, "tests", "support", "huggingface_ddp_job.py")
SAMPLES, BATCH = 48, 4  # lightning_ddp_job.py's


@pytest.fixture(scope="module")
def lightning_zygote():
    from ftkit.runtime.warm import zygote as warm

    z = warm.start(preload=("lightning.pytorch", "transformers.trainer", "transformers.models.gpt2"))
    yield z
    z.stop()


def launch(
    zygote, tmp, name: str, ckpt, nproc: int, *args: str, restarts: int = 0, job: str = JOB
) -> subprocess.CompletedProcess:
    out = tmp / name
    out.mkdir(exist_ok=True)
    cmd = torchrun_command(
        zygote,
        [
            f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            *warm_target(zygote, [job, "--ckpt", str(ckpt), "--out", str(out), *args]),
        ],
    )
    env = {**os.environ, **zygote.env(), "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)


def traces(out, world: int, attempt: int) -> list[list[dict]]:
    """Each rank's steps of one attempt, in order."""
    ranks = []
    for r in range(world):
        with open(out / f"trace-w{world}-r{r}-a{attempt}.jsonl") as f:
            ranks.append([json.loads(line) for line in f])
    return ranks


def final(out, world: int, attempt: int) -> dict:
    return torch.load(out / f"final-w{world}-a{attempt}.pt")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


def check(r: subprocess.CompletedProcess, ok: bool = True) -> None:
    assert (r.returncode == 0) == ok, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(lightning_zygote, tmp_path_factory):
    """Uninterrupted 2-rank runs, one per configuration, run on first use."""
    tmp = tmp_path_factory.mktemp("lightning-ddp")
    cache: dict[str, object] = {}

    def get(name: str, *args: str):
        if name not in cache:
            r = launch(lightning_zygote, tmp, name, tmp / f"{name}-ckpt", 2, *args)
            check(r)
            cache[name] = tmp / name
        return cache[name]

    return tmp, get


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_lightning_sigkill_then_torchrun_restart_equals_uninterrupted_run(runs, lightning_zygote, parallel):
    """Lightning's own DistributedSampler, 2 ranks, DDP or FSDP2 (ModelParallelStrategy,
    fully_shard in configure_model: parameters and optimizer state are DTensors, saved as
    each rank's shards): rank 1 is SIGKILLed after step 7's snapshot; torchrun restarts
    both; each rank re-makes its epoch iterator and skips what it had consumed. Same
    batches per rank per step, bitwise equal weights and optimizer (gathered whole)."""
    tmp, reference = runs
    flags = ("--fsdp",) if parallel == "fsdp" else ()
    ref = reference(f"reference-{parallel}", *flags)
    name = f"killed-{parallel}"
    r = launch(lightning_zygote, tmp, name, tmp / f"{name}-ckpt", 2, *flags, "--kill-at", "7", restarts=1)
    check(r)
    out = tmp / name
    done = final(out, 2, 1)
    assert done["restored"] == 7 and done["step"] == 18 and done["epoch"] == 3
    before, after, whole = traces(out, 2, 0), traces(out, 2, 1), traces(ref, 2, 0)
    for rank in range(2):
        resumed = [s for s in before[rank] if s["step"] < 7] + after[rank]
        assert resumed == whole[rank], f"rank {rank} consumed another stream"
    assert_bitwise_equal(done["final"], final(ref, 2, 0)["final"])
    manifest = newest_manifest(ftkit.Tier(str(tmp / f"{name}-ckpt")).open())
    kind = manifest.tensor("model/net.0.weight").kind
    assert kind == ("sharded" if parallel == "fsdp" else "replicated")


def stream(total: int, seed: int = 7) -> list[int]:
    """The global sample stream of ResumableDistributedSampler: epoch e's permutation, then e+1's..."""
    out: list[int] = []
    s = ftkit.ResumableDistributedSampler(SAMPLES, num_replicas=1, rank=0, seed=seed)
    while len(out) < total:
        out += list(iter(s))
        s.advance(len(s))
    return out[:total]


def consumed(ranks: list[list[dict]], until: int | None = None) -> list[list[int]]:
    """The samples the job consumed at each step (all ranks together)."""
    steps: dict[int, list[int]] = {}
    for rank in ranks:
        for s in rank:
            if until is None or s["step"] < until:
                steps.setdefault(s["step"], []).extend(s["idx"])
    return [steps[k] for k in sorted(steps)]


def test_lightning_resumable_sampler_continues_the_global_stream_from_2_ranks_to_3(runs, lightning_zygote):
    """ftkit.ResumableDistributedSampler with use_distributed_sampler=False: 2 ranks killed
    after step 7's snapshot (torchrun gives up), then the job comes back on 3 ranks. The samples
    consumed, step after step, are the one global stream cut in slices: nothing skipped,
    nothing repeated, the epoch's tail split over 3 ranks and carried into the next epoch."""
    tmp, _ = runs
    ckpt = tmp / "three-ckpt"
    check(launch(lightning_zygote, tmp, "killed-resumable", ckpt, 2, "--resumable", "--kill-at", "7"), ok=False)
    check(launch(lightning_zygote, tmp, "three", ckpt, 3, "--resumable"))
    # On 3 ranks. Step 7 ended epoch 1's first batch: 40 of its 48 samples are left, 14 a rank:
    # batches of 4, 4, 4 and 2, the last round running 2 samples into epoch 2. Epoch 2 then has
    # 46 left: 16 a rank, 4 full batches (and 2 more carried into epoch 3, which never runs).
    three = final(tmp / "three", 3, 0)
    assert three["restored"] == 7
    steps = consumed(traces(tmp / "killed-resumable", 2, 0), until=7) + consumed(traces(tmp / "three", 3, 0))
    assert [len(s) for s in steps] == [8] * 7 + [12, 12, 12, 6] + [12] * 4
    want = stream(sum(len(s) for s in steps))
    at = 0
    for k, got in enumerate(steps):
        assert sorted(got) == sorted(want[at : at + len(got)]), f"step {k} consumed other samples"
        at += len(got)
    assert three["step"] == 15 and three["epoch"] == 3


def srun(zygote, tmp, name: str, ckpt, ntasks: int, bin_dir, *args: str, restart: int = 0) -> list[tuple[int, str]]:
    """Start the Lightning job as `srun --ntasks N` would on one node: N processes with SLURM's
    variables (Lightning then runs in its SLURM environment, auto-requeue on), no torchrun;
    each forked warm from `zygote` through its thin client (the environment, a signal to the
    worker and its exit code pass through). `bin_dir` goes first on PATH (it holds the test's
    scontrol). (exit code, output) per rank."""
    import socket

    out = tmp / name
    out.mkdir(exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "RANK", "WORLD_"))}
    base |= {
        **zygote.env(),
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ftkit-requeue",
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(ntasks),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_RESTART_COUNT": str(restart),
    }
    cmd = [sys.executable, *warm_target(zygote, [JOB, "--ckpt", str(ckpt), "--out", str(out), *args])]
    procs = [
        subprocess.Popen(
            cmd,
            env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(ntasks)
    ]
    results = []
    for p in procs:
        try:
            said, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, said))
    return results


def test_lightning_under_slurm_saves_requeues_and_resumes_on_the_requeue_signal(runs, lightning_zygote, tmp_path):
    """Lightning DDP started as SLURM starts it (2 tasks, SLURM's variables, auto-requeue):
    rank 1 alone gets SIGUSR1 (SLURM's warning before the time limit) after step 3. Both ranks
    save the step they agree on and exit 128 + SIGUSR1; rank 0, having heard the signal from
    rank 1's notice, calls `scontrol requeue 4242` once (a script standing in for SLURM's, on
    PATH). The requeued run (SLURM_RESTART_COUNT=1) resumes from that step and ends bitwise
    equal to an uninterrupted run; Lightning's own handler (a save inside the signal handler,
    then its own requeue) never ran."""
    import signal

    tmp, reference = runs
    ref = reference("reference-ddp")
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "rank=$SLURM_PROCID $*" >> {calls}\n')
    scontrol.chmod(0o755)
    ckpt = tmp_path / "ckpt"
    # 0.15 s a step: rank 0 hears of the signal with a heartbeat (0.5 s), well before the run's end.
    first = srun(lightning_zygote, tmp_path, "slurm", ckpt, 2, bin_dir, "--signal-at", "3", "--step-sleep", "0.15")
    assert [rc for rc, _ in first] == [128 + signal.SIGUSR1] * 2, first[0][1][-3000:] + first[1][1][-3000:]
    assert calls.read_text().splitlines() == ["rank=0 requeue 4242"]
    saved = max(committed_steps(ftkit.Tier(str(ckpt)).open()))
    assert 3 < saved < 18  # an agreed step after the signal, before the run's end
    assert not any(n.startswith("hpc_ckpt") for n in os.listdir(REPO))  # Lightning's own save did not run
    again = srun(lightning_zygote, tmp_path, "slurm", ckpt, 2, bin_dir, restart=1)
    assert [rc for rc, _ in again] == [0, 0], again[0][1][-3000:]
    out = tmp_path / "slurm"
    done = final(out, 2, 1)
    assert done["restored"] == saved and done["step"] == 18 and done["epoch"] == 3
    before, after, whole = traces(out, 2, 0), traces(out, 2, 1), traces(ref, 2, 0)
    for rank in range(2):
        assert [s for s in before[rank] if s["step"] < saved] + after[rank] == whole[rank]
    assert_bitwise_equal(done["final"], final(ref, 2, 0)["final"])
    assert calls.read_text().splitlines() == ["rank=0 requeue 4242"]  # the finished run requeued nothing


@pytest.fixture(scope="module")
def hf_reference(lightning_zygote, tmp_path_factory):
    """The uninterrupted 2-rank HF run (DDP). FSDP2 over two gloo ranks trains to the same bits
    (its reduce-scatter of two ranks sums in the same order as DDP's all-reduce), so the FSDP2
    runs are compared with it too."""
    tmp = tmp_path_factory.mktemp("hf-reference")
    check(launch(lightning_zygote, tmp, "reference", tmp / "ckpt", 2, job=HF_JOB))
    return tmp / "reference"


@pytest.mark.parametrize(
    "parallel",
    [[], ["--fsdp", "SHARDED_STATE_DICT"]],
    ids=["ddp", "fsdp2"],
)
def test_huggingface_trainer_sigkill_then_torchrun_restart_equals_uninterrupted_run(
    lightning_zygote, hf_reference, tmp_path, parallel
):
    """transformers.Trainer, 2 ranks over gloo, DDP or FSDP2 (accelerate's plugin; its snapshots
    hold each rank's shards): rank 1 is SIGKILLed after step 7's snapshot; torchrun restarts both;
    every rank restores its own RNG and, under FSDP2, its shards of the model and optimizer.
    The same batches per rank per step, bitwise equal weights and optimizer state."""
    args = ["--kill-at", "7", *parallel]
    check(launch(lightning_zygote, tmp_path, "killed", tmp_path / "ckpt", 2, *args, restarts=1, job=HF_JOB))
    ref, out = hf_reference, tmp_path / "killed"
    done = final(out, 2, 1)
    assert done["sharded"] == bool(parallel)  # FSDP2 really ran: DTensor parameters
    assert done["restored"] == 7 and done["step"] == final(ref, 2, 0)["step"] == 18
    before, after, whole = traces(out, 2, 0), traces(out, 2, 1), traces(ref, 2, 0)
    for rank in range(2):
        resumed = [s for s in before[rank] if s["step"] < 7] + after[rank]
        assert resumed == whole[rank], f"rank {rank} trained on other batches"
    assert_bitwise_equal(done["final"], final(ref, 2, 0)["final"])
    assert not (out / "hf" / "ftkit-resume").exists()  # the shared FSDP resume directory is gone
    if parallel:
        # accelerate's own FSDP2 checkpoint of the same run (SHARDED_STATE_DICT: a DCP directory)
        # is read by `ftkit inspect` and `ftkit restore`: the final weights, whole.
        model_dir = out / "accelerate" / "pytorch_model_fsdp_0"
        r = run_cli("inspect", str(model_dir), "--json")
        assert r.returncode == 0, r.stderr
        listed = {t["name"]: t["shape"] for t in json.loads(r.stdout)["tensor_list"]}
        weights = {k.removeprefix("model/"): v for k, v in done["final"].items() if k.startswith("model/")}
        assert listed == {f"model.{k}": list(v.shape) for k, v in weights.items()}
        r = run_cli("restore", str(model_dir), "--out", str(out / "accelerate.pt"))
        assert r.returncode == 0, r.stderr
        restored = torch.load(out / "accelerate.pt")["model"]
        assert_bitwise_equal(restored, weights)


def hf_stream(total: int, seed: int = 0) -> list[int]:
    """The HF Trainer's global sample stream: accelerate's seedable sampler draws epoch t's
    permutation with seed + t; the job reads epoch 0's, then epoch 1's, ..."""
    from accelerate.data_loader import SeedableRandomSampler

    sampler, out, epoch = SeedableRandomSampler(range(SAMPLES), data_seed=seed), [], 0
    while len(out) < total:
        sampler.set_epoch(epoch)
        out += list(iter(sampler))
        epoch += 1
    return out[:total]


@pytest.mark.parametrize("parallel", [[], ["--fsdp", "FULL_STATE_DICT"]], ids=["ddp", "fsdp2"])
def test_huggingface_trainer_continues_the_global_stream_from_2_ranks_to_3(lightning_zygote, tmp_path, parallel):
    """transformers.Trainer on 2 ranks (DDP, or FSDP2 with the Trainer's full state-dict
    type), killed after step 9's snapshot (mid-epoch: 6 steps an epoch there); the job comes
    back on 3 ranks, where the Trainer's own resume would count 4 steps an epoch and start
    elsewhere (and FSDP2 shards every tensor 3 ways). The samples consumed, step after step,
    are the one global stream cut in slices of 8 then 12: nothing skipped, nothing repeated.
    The run ends where the Trainer's step count on 3 ranks says (3 epochs x 4 steps)."""
    ckpt = tmp_path / "ckpt"
    check(launch(lightning_zygote, tmp_path, "two", ckpt, 2, "--kill-at", "9", *parallel, job=HF_JOB), ok=False)
    check(launch(lightning_zygote, tmp_path, "three", ckpt, 3, *parallel, job=HF_JOB))
    three = final(tmp_path / "three", 3, 0)
    assert three["sharded"] == bool(parallel)
    assert three["restored"] == 9 and three["step"] == 12
    steps = consumed(traces(tmp_path / "two", 2, 0), until=9) + consumed(traces(tmp_path / "three", 3, 0))
    assert [len(s) for s in steps] == [8] * 9 + [12] * 3
    want = hf_stream(sum(len(s) for s in steps))
    at = 0
    for k, got in enumerate(steps):
        assert sorted(got) == sorted(want[at : at + len(got)]), f"step {k} consumed other samples"
        at += len(got)


# The notice reaches the other rank through the store about a heartbeat later (~10 steps of
# 0.05 s here): the agreed stop lands before the run's end. The HF drill leaves out the kill
# (its SIGKILL test above) and the hang (the same watchdog path as Lightning's): CI time.
DRILLS = {
    "lightning": (
        "lightning_ddp.py",
        "lightning.pytorch",
        "kill@10:rank=1,hang@20:rank=0,crash@30:rank=1,term@36:rank=0",
    ),
    "huggingface": (
        "huggingface_ddp.py",
        "transformers.trainer,transformers.models.gpt2",
        "crash@10:rank=1,term@20:rank=0",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer", sorted(DRILLS))
def test_drill_of_the_trainer_example_scripts(tmp_path, trainer):
    """`ftkit drill --script` on examples/: 2 ranks under torchrun, killed, stopped (the
    watchdog's case), an exception in the trainer's loop, and a preemption notice. Every
    fault is recovered from within a step (none for the notice: the agreed step is saved),
    the run finishes, and its newest durable step verifies."""
    script, preload, faults = DRILLS[trainer]
    ckpt = tmp_path / "ckpt"
    rc, res, out = drill(
        tmp_path,
        *("--script", os.path.join(REPO, "examples", script), "--preload", preload),
        *("--nproc", "2", "--steps", "60", "--faults", faults, "--", "--ckpt", str(ckpt), "--steps", "60"),
    )
    assert rc == 0 and res["passed"], out[-4000:]
    assert list(res["checkpoints"].values()) == [60]  # the final step, verified
    f = by_kind(res)
    assert set(f) == {fault.split("@")[0] for fault in faults.split(",")}
    for kind in ("kill", "hang", "crash"):
        if kind in f:
            o = f[kind]["outcome"]
            # The step before the fault, and the snapshot still in flight if the fault struck
            # before it committed (a loaded machine's pipeline can lag a step; the drill's rule)
            assert o["steps_lost"] <= 1 + bool(o["snapshot_in_flight"]), (kind, o)
            assert o["restored_from"] == "ram"
    if "hang" in f:
        assert f["hang"]["outcome"]["detected_by"].startswith("ftkit watchdog")
    term = f["term"]["outcome"]
    assert term["detected_by"] == "preemption (SIGTERM)" and term["steps_lost"] == 0
