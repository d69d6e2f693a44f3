"""The old README's `ftkit.dist.init_process_group` still starts a working group (issue 35, item 10).

A trainer written against it runs under plain torchrun (2 gloo ranks on CPU), is told
what to use instead (a DeprecationWarning pointing at its own call), and gets a group
whose collectives work, formed through ftkit's restart-safe rendezvous.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from conftest import REPO

OLD_TRAINER = """
import sys
import warnings
import torch
import torch.distributed as dist
import ftkit.dist
from ftkit.coord.rendezvous import installed

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ftkit.dist.init_process_group("gloo", timeout_s=60)  # as the old README said
told = [w for w in caught if issubclass(w.category, DeprecationWarning)]
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
here = all(w.filename == __file__ for w in told)
with open(f"{sys.argv[1]}/rank-{dist.get_rank()}.txt", "w") as f:  # (one file a rank: no interleaved output)
    f.write(f"SUM {t.item():.0f} WARNED {len(told)} HERE {here} RDZV {installed()}\\n")
    f.write(f"MESSAGE {told[0].message if told else None}\\n")
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_the_old_init_process_group_warns_and_its_group_works(tmp_path):
    script = tmp_path / "old_trainer.py"
    script.write_text(OLD_TRAINER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=110, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for rank in (0, 1):
        said = (tmp_path / f"rank-{rank}.txt").read_text()
        assert said.startswith("SUM 3 WARNED 1 HERE True RDZV True\n"), said  # 1 + 2: both ranks took part
        assert "torch.distributed.init_process_group after `import ftkit`" in said, said


def test_the_old_modules_other_names_warn_and_still_resolve():
    from ftkit.coord import dist as moved

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from ftkit.dist import DistContext, node_id
    assert DistContext is moved.DistContext and node_id is moved.node_id
    assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
    assert all(w.filename == __file__ for w in caught)
    with pytest.raises(ImportError):
        from ftkit.dist import no_such_name  # noqa: F401
