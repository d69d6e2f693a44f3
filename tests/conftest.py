"""Shared fixtures: a real S3 server (SeaweedFS), small training states, helpers."""

from __future__ import annotations

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
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, 4))
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


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `ftkit ARGS` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "ftkit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout, cwd=REPO)


@pytest.fixture
def gated_fs():
    """A memory filesystem (protocol gated://) whose file writes block until the gate opens."""
    from gatedfs import GatedFileSystem

    GatedFileSystem.gate.set()
    GatedFileSystem.store.clear()
    GatedFileSystem.pseudo_dirs[:] = [""]
    yield GatedFileSystem
    GatedFileSystem.gate.set()
