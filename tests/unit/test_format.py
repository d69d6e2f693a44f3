"""The format is readable without ftkit: the FORMAT.md recipe, run as documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
from conftest import REPO, run_cli

import ftkit
from ftkit.format.manifest import FORMAT_VERSION
from ftkit.format.reader import load_manifest


def _format_md_recipe(step_dir, tmp_path):
    """FORMAT.md's plain-Python reader run on `step_dir` in a process where ftkit cannot be
    imported; the tensor `w` it reads."""
    import numpy as np

    recipe = re.search(r"```python\n(.*?)```", open(os.path.join(REPO, "FORMAT.md")).read(), re.S).group(1)
    script = (
        "import sys; sys.modules['ftkit'] = None\n"  # prove ftkit is not needed
        + recipe.replace('"ckpt/step-000000000120"', repr(str(step_dir)))
        + "\nnp.save(sys.argv[1], w)\n"
    )
    out = tmp_path / "w.npy"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return np.load(out)


def test_format_md_recipe_reads_a_tensor_without_ftkit_also_split_across_ranks(tmp_path):
    import numpy as np

    w = torch.randn(1024, 320)  # over save/sharding.py's SPLIT_BYTES: split in row blocks across ranks
    ckpt = tmp_path / "ckpt"
    with ftkit.Checkpointer({"model": {"fc.weight": w}}, [ftkit.Tier(str(ckpt), compress="zstd")], rng=False) as ck:
        ck.snapshot(120)
    # A dict of tensors is a plain value: tensors inside it still become entries. The same step
    # laid out for 3 ranks (as a 3-rank job writes it): one shard per rank.
    assert run_cli("restore", str(ckpt), "--out", str(tmp_path / "ckpt3"), "--world-size", "3").returncode == 0
    shards = load_manifest(ftkit.Tier(str(tmp_path / "ckpt3")).open(), 120).tensor("model/fc.weight").shards
    assert len(shards) == 3
    for root in (ckpt, tmp_path / "ckpt3"):
        assert np.array_equal(_format_md_recipe(root / "step-000000000120", tmp_path), w.numpy()), root


def test_format_md_recipe_reads_a_zstd_tensor_that_a_4_rank_2_node_job_saved_in_both_nodes_parts(tmp_path):
    import dist_worker
    import numpy as np
    from ranks import run_ranks

    ckpt = tmp_path / "ckpt"
    run_ranks(4, dist_worker.save_for_format_recipe, str(ckpt), env={"FTKIT_RANKS_PER_NODE": "2"}, timeout=90)
    m = load_manifest(ftkit.Tier(str(ckpt)).open(), 120)
    assert len(m.parts) == 2 and {c.codec for s in m.tensor("model/fc.weight").shards for c in s.chunks} == {"zstd"}
    assert np.array_equal(_format_md_recipe(ckpt / "step-000000000120", tmp_path), dist_worker.recipe_weight().numpy())


def test_manifest_declares_format_and_version_first(tmp_path):
    with ftkit.Checkpointer({"t": torch.ones(3)}, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
    raw = (tmp_path / "step-000000000001" / "manifest.json").read_bytes()
    assert raw.startswith(b'{"format":"ftkit-checkpoint","format_version":%d' % FORMAT_VERSION)
    assert b"pickle" not in raw and load_manifest(ftkit.Tier(str(tmp_path)).open(), 1).step == 1
