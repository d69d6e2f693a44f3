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


@pytest.fixture
def gated_fs():
    """A memory filesystem (protocol gated://) whose file writes block until the gate opens."""
    from gatedfs import GatedFileSystem

    GatedFileSystem.gate.set()
    GatedFileSystem.store.clear()
    GatedFileSystem.pseudo_dirs[:] = [""]
    yield GatedFileSystem
    GatedFileSystem.gate.set()
