"""Nothing crafted reaches the live state (issue 35): a restore loads a verified step whole,
or leaves the live state exactly as it was.

Every case is a crafted checkpoint on disk, written the way a corrupted or hostile tier
would hold it (manifest parts rehashed so the edit passes their checksums), read by the
real library, the real CLI, real processes and a real store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import xxhash
import zstandard
from conftest import REPO, edit_manifest, manifest_doc, run_cli, write_manifest_doc
from livestate import Counter, equal, fingerprint, live_state, values
from ranks import run_ranks

import ftkit
from ftkit.errors import CorruptCheckpointError, StateMismatchError
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name

MAXRSS_KIB = 1_000_000  # a subprocess that imports torch and restores a small state stays well below 1 GB


@pytest.fixture
def saved(tmp_path):
    """Steps 1 and 2 of live_state(1) trained on; the values of each step."""
    root = tmp_path / "ckpt"
    state = live_state(1)
    refs = {}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)], rng=True) as ck:
        for step in (1, 2):
            state["model"](torch.randn(4, 8)).square().mean().backward()
            state["optim"].step()
            state["counter"].count += 1
            state["w"].add_(1.0)
            state["epoch"] += 1
            ck.snapshot(step)
            ck.wait()
            refs[step] = values(state)
    return root, refs


def manifest(root, step: int = 2):
    return root / step_dir_name(step) / MANIFEST_NAME


def restore(root, state, step=None) -> int:
    with ftkit.Checkpointer(state, [str(root)], rng=True) as ck:
        return ck.restore(step=step)


# ------------------------------------------- 1. a saved entry must be of the live entry's kind
def _entry(doc, key: str):
    return doc["skeleton"]["entries"][key]["value"]


def _optim_entry(doc) -> list:
    return doc["skeleton"]["entries"]["optim"]["value"]["state"]["$items"]


CRAFTED_KINDS = {
    "model as a plain value": ("model", lambda d: d["skeleton"]["entries"].update(model={"kind": "value", "value": 5})),
    "model's state_dict a number": (
        "model",
        lambda d: d["skeleton"]["entries"].update(model={"kind": "stateful", "value": 5}),
    ),
    "a plain value for a tensor": ("w", lambda d: d["skeleton"]["entries"].update(w={"kind": "tensor", "value": 5})),
    "an object for a plain value": (
        "epoch",
        lambda d: d["skeleton"]["entries"].update(epoch={"kind": "stateful", "value": {"count": 1}}),
    ),
    "a mapping for a plain value": ("epoch", lambda d: d["skeleton"]["entries"]["epoch"].update(value={"a": 1})),
    "a number for an optimizer's tensor": ("optim", lambda d: _optim_entry(d)[0][1].update(exp_avg=5)),
    "a list for a user object's count": (
        "counter",
        lambda d: d["skeleton"]["entries"]["counter"]["value"].update(count=[1]),
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED_KINDS))
def test_a_saved_entry_of_another_kind_is_refused_before_anything_changes(saved, case):
    root, _ = saved
    key, craft = CRAFTED_KINDS[case]
    edit_manifest(manifest(root), craft)
    state = live_state(7)
    before = fingerprint(state)
    with pytest.raises(StateMismatchError, match=key):
        restore(root, state)
    assert fingerprint(state) == before
    assert isinstance(state["model"], torch.nn.Module)


# ------------------------------------------- 2. a failed restore leaves the live state as it was
def test_a_load_refused_part_way_falls_back_to_the_step_before(saved):
    """The model and optimizer of step 2 load, then the user object refuses its entry: every
    object goes back, and step 1 loads whole."""
    root, refs = saved
    edit_manifest(manifest(root), lambda d: d["skeleton"]["entries"]["counter"]["value"].update(count=-1))
    state = live_state(7)
    assert restore(root, state) == 1
    assert equal(values(state), refs[1])


def test_an_optimizer_that_refuses_its_groups_falls_back_too(saved):
    root, refs = saved
    edit_manifest(
        manifest(root), lambda d: d["skeleton"]["entries"]["optim"]["value"]["param_groups"][0]["params"].pop()
    )
    state = live_state(7)
    assert restore(root, state) == 1
    assert equal(values(state), refs[1])


def _flip_last_byte(root, step):
    for f in (root / step_dir_name(step)).glob("*.data"):
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x01  # the last tensor in the file: every earlier one was read into the live state first
        f.write_bytes(bytes(raw))


CANDIDATES_FAIL = {
    "every load refused": lambda root: [
        edit_manifest(manifest(root, s), lambda d: d["skeleton"]["entries"]["counter"]["value"].update(count=-1))
        for s in (1, 2)
    ],
    "every step fails a checksum": lambda root: [_flip_last_byte(root, s) for s in (1, 2)],
}


@pytest.mark.parametrize("case", sorted(CANDIDATES_FAIL))
def test_when_every_candidate_fails_the_live_state_is_byte_for_byte_unchanged(saved, case):
    root, _ = saved
    CANDIDATES_FAIL[case](root)
    state = live_state(7)
    before = fingerprint(state)
    with pytest.raises(CorruptCheckpointError, match="live state is as it was"):
        restore(root, state)
    assert fingerprint(state) == before


def _rank_local_job(rank: int, world: int, root: str, crafted: bool):
    """Save two steps of a state with a RankLocal counter, or restore them; return what was restored."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 4)
    counter = Counter(100 + rank)
    state = {"model": model, "counter": ftkit.RankLocal(counter)}
    with ftkit.Checkpointer(state, [str(root)], rng=False) as ck:
        if not crafted:
            for step in (1, 2):
                with torch.no_grad():
                    model.weight.fill_(step)
                counter.count = step * 10 + rank
                ck.snapshot(step)
                ck.wait()
            return None
        before = model.weight.clone(), counter.count
        step = ck.restore()
        return step, float(model.weight[0, 0]), counter.count, before[1]


def test_a_load_refused_on_one_rank_sends_every_rank_back(tmp_path):
    """Rank 1's own state in step 2 is crafted so its load refuses; rank 0's loads fine. The
    ranks vote after loading: both go back and both restore step 1, whole."""
    root = tmp_path / "ckpt"
    run_ranks(2, _rank_local_job, str(root), False)
    edit_manifest(manifest(root), lambda d: d["rank_state"]["1"]["local"]["counter"]["value"].update(count=-5))
    got = run_ranks(2, _rank_local_job, str(root), True)
    assert got == [(1, 1.0, 10, 100), (1, 1.0, 11, 101)]


# ------------------------------------------- 3. Python's own conversion errors never escape
CONVERSIONS = {
    "created_at of 5,000 digits": ("created_at", "1" * 5000),
    "created_at 1 followed by 400 zeros": ("created_at", "1" + "0" * 400),
    "a rank_state key of a superscript two": ("rank_state_key", "\\u00b2"),
}


@pytest.mark.parametrize("case", sorted(CONVERSIONS))
def test_numbers_python_cannot_convert_are_a_bad_step_not_a_traceback(saved, case):
    root, refs = saved
    field, text = CONVERSIONS[case]
    doc = manifest_doc(manifest(root))
    if field == "created_at":
        doc["created_at"] = "__CRAFTED__"
        write_manifest_doc(manifest(root), doc, lambda t: t.replace('"__CRAFTED__"', text))
    else:
        doc["rank_state"]["__CRAFTED__"] = doc["rank_state"]["0"]
        write_manifest_doc(manifest(root), doc, lambda t: t.replace('"__CRAFTED__"', f'"{text}"'))
    for args in (("ls", str(root)), ("ls", str(root), "--json"), ("verify", str(root), "--step", "2")):
        r = run_cli(*args)
        assert "Traceback" not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert r.returncode == (0 if args[0] == "ls" else 1), (args, r.stdout, r.stderr)
    listed = json.loads(run_cli("ls", str(root), "--json").stdout)["steps"]
    assert [(s["step"], s["status"]) for s in listed] == [(1, "committed"), (2, "bad-manifest")]
    state = live_state(7)
    assert restore(root, state) == 1
    assert equal(values(state), refs[1])


# ------------------------------------------- 4. memory is never allocated on a manifest's word
def _run_measured(code: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run `code` in a fresh interpreter; (the result, its peak RSS in KiB)."""
    wrapped = (
        "import resource, sys\n"
        "def _done(rc=0):\n"
        "    print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
        "    sys.exit(rc)\n" + code
    )
    r = subprocess.run([sys.executable, "-c", wrapped, *args], capture_output=True, text=True, cwd=REPO, timeout=240)
    rss = [int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("MAXRSS")]
    assert rss, r.stdout + r.stderr
    return r, rss[0]


CLI = "from ftkit.tools.cli import main\n_done(main(sys.argv[1:]))\n"
RESTORE = (
    "import json, torch, ftkit, livestate as t\n"
    "state = t.live_state(7)\n"
    "state.update(json.loads(sys.argv[2]))\n"
    "with ftkit.Checkpointer(state, [sys.argv[1]], rng=True) as ck:\n"
    "    step = ck.restore()\n"
    "print(step, json.dumps(t.equal(t.values(state), torch.load(sys.argv[3], weights_only=False))))\n"
    "_done()\n"
)


def _add_tensor(doc, name: str, dtype: str, shape: list[int], chunks: list[dict], file_bytes: int, file: str) -> None:
    doc["files"][file] = {"bytes": file_bytes, "rank": 0}
    doc["tensors"].append(
        {
            "name": name,
            "dtype": dtype,
            "shape": shape,
            "kind": "replicated",
            "shards": [{"offsets": [0] * len(shape), "lengths": shape, "rank": 0, "chunks": chunks}],
        }
    )


BAD_FILE = "rank-00000-0bad0bad.data"


def _raw_chunks(file: str, size: int) -> list[dict]:
    """`size` bytes of `file` as the chunks a writer makes (16 MiB each, the most the format allows)."""
    step = 2**24
    return [
        {
            "file": file,
            "offset": at,
            "length": step,
            "raw_offset": at,
            "raw_length": step,
            "codec": "raw",
            "checksum": "xxh3_64:0123456789abcdef",
        }
        for at in range(0, size, step)
    ]


def _sparse(path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)  # a size, and no byte stored


def _restore_measured(root, tmp_path, refs, step: int, extra: dict | None = None) -> tuple[str, int]:
    ref = tmp_path / "ref.pt"
    torch.save(refs[step], ref)
    code = "sys.path.insert(0, 'tests/support')\n" + RESTORE
    r, rss = _run_measured(code, str(root), json.dumps(extra or {}), str(ref))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), rss


def test_an_orphan_tensor_of_256_gib_is_never_allocated(saved, tmp_path):
    """A tensor in the manifest that nothing in the state names, backed by a sparse file of
    256 GiB: the restore reads only what the live state needs, and loads step 2 whole."""
    root, refs = saved
    step_dir = root / step_dir_name(2)
    _sparse(step_dir / "rank-00000-0bad0bad.data", 2**38)
    chunks = _raw_chunks("rank-00000-0bad0bad.data", 2**38)
    edit_manifest(manifest(root), lambda d: _add_tensor(d, "orphan", "float32", [2**36], chunks, 2**38, BAD_FILE))
    out, rss = _restore_measured(root, tmp_path, refs, 2)
    assert out == "2 true"
    assert rss < MAXRSS_KIB, rss


def test_a_claim_of_256_gib_for_a_fresh_optimizer_falls_back_within_memory(saved, tmp_path):
    """Step 2 says the optimizer's first moment is 256 GiB (a sparse file): the live state has
    no such tensor to read into, the host has not that memory, so step 2 is unusable and
    step 1 loads."""
    root, refs = saved
    step_dir = root / step_dir_name(2)
    _sparse(step_dir / "rank-00000-0bad0bad.data", 2**38)
    chunks = _raw_chunks("rank-00000-0bad0bad.data", 2**38)

    def craft(d):
        _add_tensor(d, "huge", "float32", [2**36], chunks, 2**38, BAD_FILE)
        _optim_entry(d)[0][1]["exp_avg"] = {"$tensor": "huge"}

    edit_manifest(manifest(root), craft)
    code = "sys.path.insert(0, 'tests/support')\n" + RESTORE.replace(
        "state = t.live_state(7)\n",
        "state = t.live_state(7)\nstate['optim'] = torch.optim.Adam(state['model'].parameters(), lr=1e-2)\n",
    )
    ref = tmp_path / "ref.pt"
    torch.save(refs[1], ref)
    r, rss = _run_measured(code, str(root), "{}", str(ref))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1 true" and "GiB of new memory" in r.stderr
    assert rss < MAXRSS_KIB, rss


def _zstd_bomb(doc, step_dir, claimed: int) -> None:
    """A tensor of `claimed` raw bytes in one zstd chunk whose frame really holds 1/32768th of
    that (the most the format allows; its checksum recomputed to match), named by the state's
    plain value entry "extra"."""
    frame = zstandard.ZstdCompressor().compress(os.urandom(claimed // 32768))
    name = "rank-00000-b0b0b0b0.data"
    (step_dir / name).write_bytes(frame)
    chunk = {
        "file": name,
        "offset": 0,
        "length": len(frame),
        "raw_offset": 0,
        "raw_length": claimed,
        "codec": "zstd",
        "checksum": "xxh3_64:" + xxhash.xxh3_64_hexdigest(frame),
    }
    _add_tensor(doc, "bomb", "uint8", [claimed], [chunk], len(frame), name)
    doc["skeleton"]["entries"]["extra"] = {"kind": "value", "value": {"$tensor": "bomb"}}


def test_a_zstd_chunk_claiming_4_gib_is_decoded_in_steps_and_refused(saved, tmp_path):
    root, refs = saved
    edit_manifest(manifest(root), lambda d: _zstd_bomb(d, root / step_dir_name(2), 2**32))
    out, rss = _restore_measured(root, tmp_path, refs, 1)
    assert out == "1 true"
    assert rss < MAXRSS_KIB, rss


@pytest.mark.parametrize("command", ["verify", "gc"])
def test_a_zstd_chunk_claiming_32_gib_costs_verify_and_gc_no_memory(saved, command):
    root, _ = saved
    edit_manifest(manifest(root), lambda d: _zstd_bomb(d, root / step_dir_name(2), 2**35))
    args = [command, str(root)] + (["--step", "2"] if command == "verify" else ["--keep", "1", "--dry-run", "--json"])
    r, rss = _run_measured(CLI, *args)
    assert "Traceback" not in r.stdout + r.stderr
    assert rss < MAXRSS_KIB, rss
    refused = "holds 34359738368 raw bytes, more than the 16777216 of any chunk"  # (refused unread)
    if command == "verify":
        assert r.returncode == 1 and refused in r.stdout, r.stdout
    else:
        assert r.returncode == 0, r.stdout + r.stderr
        done = json.loads(r.stdout)
        assert done["protected"] == 1 and refused in done["failed_verification"]["2"], done
        assert (root / step_dir_name(1) / MANIFEST_NAME).exists() and manifest(root).exists()


def test_a_sparse_part_of_1_gib_is_refused_unread(saved, tmp_path):
    root, refs = saved
    index = json.loads(manifest(root).read_text())
    part = root / step_dir_name(2) / index["parts"][0]["file"]
    _sparse(part, 2**30)
    index["parts"][0]["bytes"] = 2**30
    manifest(root).write_text(json.dumps(index))
    r, rss = _run_measured(CLI, "ls", str(root), "--json")
    assert r.returncode == 0 and rss < MAXRSS_KIB, (rss, r.stderr)
    steps = json.loads(r.stdout)["steps"]
    assert steps[1]["status"] == "bad-manifest" and "sparse" in steps[1]["error"], steps
    r = run_cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "sparse" in r.stdout and "Traceback" not in r.stdout + r.stderr
    state = live_state(7)
    assert restore(root, state) == 1 and equal(values(state), refs[1])


def test_a_part_larger_than_any_writer_makes_is_refused_unread(saved):
    root, _ = saved
    index = json.loads(manifest(root).read_text())
    index["parts"][0]["bytes"] = 2**31
    manifest(root).write_text(json.dumps(index))
    r = run_cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr


# ------------------------------------------- 8. names and keys from the store
def _crafted_inventory_job(rank: int, world: int, root: str, restore_now: bool):
    """Two nodes of one rank, a RAM tier and a disk tier; on restore, rank 1 (its node's
    leader) reports a crafted inventory through the real store."""
    os.environ["FTKIT_NODE_ID"] = f"n{rank}"
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 4)
    tiers = [ftkit.Tier("ram"), ftkit.Tier(os.path.join(root, "disk"), every=1)]
    with ftkit.Checkpointer({"model": model}, tiers, rng=False, run_id="crafted") as ck:
        if not restore_now:
            for step in (1, 2):
                with torch.no_grad():
                    model.weight.fill_(step)
                ck.snapshot(step)
                ck.wait()
            return None
        if rank == 1:
            import ftkit.restore as restore_module

            real = restore_module.ram_inventory

            def crafted(rc):
                from ftkit.commit.messages import Held, Inventory

                inventory, manifests = real(rc)
                steps = [replace(h, have=(*h.have, "part-/../../../etc/passwd.json")) for h in inventory.steps]
                steps.append(Held(3, ("../x.data",), ("../x.data",), "d"))
                steps.append(Held(4, (), None, None, "i", ("part-/../x.json",)))
                return Inventory(tuple(steps)), manifests

            restore_module.ram_inventory = crafted
        step = ck.restore()
        return step, float(model.weight[0, 0])


def test_crafted_inventories_through_the_store_are_skipped_not_followed(tmp_path):
    env = {"FTKIT_RAM_DIR": str(tmp_path / "shm")}
    run_ranks(2, _crafted_inventory_job, str(tmp_path), False, env=env)
    assert run_ranks(2, _crafted_inventory_job, str(tmp_path), True, env=env) == [(2, 2.0), (2, 2.0)]
