"""Shared fixtures: a real S3 server (SeaweedFS), small training states, helpers."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
from s3fixture import s3_server, s3_url  # noqa: F401  (fixtures)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")

# The files that take longest (minutes of drills and torchrun restarts), longest first, by
# their path below tests/. scripts/test.sh runs two workers, one file at a time each, in
# collection order (--no-loadscope-reorder): the first two start at once, the next as a worker
# frees, and the short files fill in around them,
# instead of a drill starting last and running alone at the end (a minute of the CI run).
SLOW_FILES = (
    "drills/test_hosts_drill.py",  # (two drills over emulated hosts, ~80 s each)
    "drills/test_drill_faults.py",
    "drills/test_drill.py",
    "drills/test_integrations_multiprocess.py",
    "drills/test_unmodified_trainer.py",
    "drills/test_watchdog.py",
    "drills/test_inprocess.py",
    "processes/test_isolation.py",
    "processes/test_ram_peer.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    missing = [f for f in SLOW_FILES if not os.path.isfile(os.path.join(TESTS, f))]
    if missing:  # a file moved or renamed: it would silently lose its early start
        raise pytest.UsageError(f"tests/conftest.py SLOW_FILES names files that are not there: {missing}")
    rank = {os.path.realpath(os.path.join(TESTS, f)): i for i, f in enumerate(SLOW_FILES)}
    place = {path: rank.get(os.path.realpath(path), len(SLOW_FILES)) for path in {item.path for item in items}}
    items.sort(key=lambda item: place[item.path])  # (stable: the rest keep their order)


def make_state(seed: int = 0, width: int = 16):
    """A small model + optimizer + scheduler after one real step, and a plain value."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sched.step()
    return {"model": model, "optim": opt, "sched": sched, "epoch": 1}


def train_one(state) -> None:
    m, opt = state["model"], state["optim"]
    opt.zero_grad()
    m(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    state["sched"].step()
    state["epoch"] += 1


def snapshot_values(state) -> dict[str, torch.Tensor]:
    """Every tensor of model and optimizer, cloned, by name."""
    out = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for pid, st in state["optim"].state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{pid}/{k}"] = v.clone()
    return out


def assert_same_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 120, in_process: bool | None = None
) -> subprocess.CompletedProcess:
    """Run `ftkit ARGS` and capture its exit code, stdout and stderr.

    In-process by default (the same `main()` the console script calls, minus
    ~2 s of interpreter start-up per call); in a subprocess when `env` is given
    or asked for, as a user's shell would run it.
    """
    if in_process is None:
        in_process = env is None
    if not in_process:
        return subprocess.run(
            [sys.executable, "-m", "ftkit", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
            cwd=REPO,
        )
    from ftkit.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["ftkit", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def zygote():
    """One warm-start zygote (ftkit/runtime/warm) per test worker, as `ftkit run` keeps one per node.

    The torchrun tests hand it to warm_target(): torchrun (the real launcher and
    elastic agent) starts thin clients and every worker of every attempt is forked
    with torch imported, instead of a new interpreter importing it again (seconds per
    worker on this 2-core machine); torchrun itself starts through it too
    (ftkit.runtime.warm.zygote.torchrun_command). Tests of cold starts and plain torchrun stay
    cold, and so do those that kill an agent's process tree (test_elastic.py).
    """
    from ftkit.runtime.warm import zygote as warm

    z = warm.start(preload=("torch.distributed.fsdp", "torch.distributed.run", "ftkit.drill.reference"))
    yield z
    z.stop()


def warm_target(zygote, target: list[str]) -> list[str]:
    """SCRIPT ARGS (or -m MODULE ARGS), rewritten to start through `zygote`'s thin
    client, as `ftkit run` rewrites them; the job's environment needs zygote.env() too."""
    from ftkit.runtime.warm.zygote import client_path

    if target[0] in ("-m", "--module"):
        return [client_path(), "--module", *target[1:]]
    return [client_path(), *target]


@pytest.fixture
def gated_fs():
    """A memory filesystem (protocol gated://) whose file writes block until the gate opens."""
    from gatedfs import GatedFileSystem

    GatedFileSystem.gate.set()
    GatedFileSystem.store.clear()
    GatedFileSystem.pseudo_dirs[:] = [""]
    yield GatedFileSystem
    GatedFileSystem.gate.set()


# ------------------------------------------------------------- editing manifests
def manifest_doc(path) -> dict:
    """A step's manifest as one document (the single-document form), whichever form is
    on disk: a version-3 index is merged with its one part (steps saved by one process)."""
    import json

    from ftkit.format.part import decode_part

    doc = json.loads(open(path).read())
    if doc.get("format_version") not in (3, 4):
        return doc
    (ref,) = doc.pop("parts")
    raw = open(os.path.join(os.path.dirname(path), ref["file"]), "rb").read()
    part = decode_part(raw, ref["file"]) if doc["format_version"] == 4 else json.loads(raw)
    return {**doc, "tensors": part["tensors"], "files": part["files"], "rank_state": part["rank_state"]}


def write_manifest_doc(path, doc: dict, transform=None) -> None:
    """Write back what manifest_doc() gave (maybe edited): as an index and its part when it
    says version 3 or 4, rehashing the part so the edit reaches the validation behind it. A
    version-4 part holds only what its three lines can say: an edit they cannot (a list where
    the files go) is written as a version-3 part and index, which readers still read.
    `transform`: applied to each JSON text before it is written (to inject what json.dumps
    cannot write, such as 1e400)."""
    import json
    import uuid

    import xxhash

    from ftkit.format.part import encode_part_docs

    transform = transform or (lambda text: text)
    if doc.get("format_version") not in (3, 4):
        open(path, "w").write(transform(json.dumps(doc)))
        return
    split = ("tensors", "files", "rank_state")
    world = doc.get("world_size") if isinstance(doc.get("world_size"), int) and doc["world_size"] > 0 else 1
    part = {"format": "ftkit-checkpoint-part", "step": doc.get("step"), "ranks": [[0, world]]}
    part.update({k: doc[k] for k in split if k in doc})
    data = None
    if doc["format_version"] == 4:
        try:
            data = transform(encode_part_docs(doc["step"], list(range(world)), *(doc[k] for k in split)).decode())
        except Exception:  # not what a version-4 part can say
            doc = {**doc, "format_version": 3}
    data = (data if data is not None else transform(json.dumps(part))).encode()
    name = f"part-00000-{uuid.uuid4().hex[:8]}.json"
    for old in os.listdir(os.path.dirname(path)):
        if old.startswith("part-"):
            os.unlink(os.path.join(os.path.dirname(path), old))
    open(os.path.join(os.path.dirname(path), name), "wb").write(data)
    ref = {"file": name, "bytes": len(data), "checksum": "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)}
    index = {k: v for k, v in doc.items() if k not in split}
    index["parts"] = [{**ref, "ranks": [[0, world]]}]
    open(path, "w").write(transform(json.dumps(index)))


def edit_manifest(path, fn) -> None:
    doc = manifest_doc(path)
    fn(doc)
    write_manifest_doc(path, doc)
