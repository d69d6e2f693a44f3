"""The format is readable without ftkit: the FORMAT.md recipe, run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
from conftest import REPO

import ftkit
from ftkit.format.manifest import FORMAT_VERSION
from ftkit.format.reader import load_manifest


def test_format_md_recipe_reads_a_tensor_without_ftkit(tmp_path):
    w = torch.randn(64, 32)
    ckpt = tmp_path / "ckpt"
    with ftkit.Checkpointer({"model": {"fc.weight": w}}, [ftkit.Tier(str(ckpt), compress="zstd")], rng=False) as ck:
        ck.snapshot(120)
    # A dict of tensors is a plain value: tensors inside it still become entries.
    doc = open(os.path.join(REPO, "FORMAT.md")).read()
    recipe = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    script = (
        "import sys; sys.modules['ftkit'] = None\n"  # prove ftkit is not needed
        + recipe.replace('"ckpt/step-000000000120"', repr(str(ckpt / "step-000000000120")))
        + "\nnp.save(sys.argv[1], w)\n"
    )
    out = tmp_path / "w.npy"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    import numpy as np

    assert np.array_equal(np.load(out), w.numpy())


def test_manifest_declares_format_and_version_first(tmp_path):
    with ftkit.Checkpointer({"t": torch.ones(3)}, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    raw = (tmp_path / "step-000000000001" / "manifest.json").read_bytes()
    assert raw.startswith(b'{"format":"ftkit-checkpoint","format_version":%d' % FORMAT_VERSION)
    assert b"pickle" not in raw and load_manifest(ftkit.Tier(str(tmp_path)).open(), 1).step == 1
