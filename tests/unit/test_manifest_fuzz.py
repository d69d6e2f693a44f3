"""Property-style fuzzing of the manifest validator (issue 12).

Random mutations of real manifests (types, numbers, lengths, names, structure),
written to disk and read by the real reader and CLI. Properties:

* parsing raises nothing but FormatError;
* `verify` and the CLI never crash (exit 0 or 1, no traceback);
* when verify says OK, reading succeeds, every tensor has its declared shape
  and dtype, nothing allocated exceeds the stored bytes (x32768 for zstd, the
  codec's bound), and every tensor whose entry the mutation left alone holds
  exactly its original values.

Seeds are fixed: a failure reproduces with the seed in its message.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from conftest import make_state, manifest_doc, run_cli, write_manifest_doc

import ftkit
from ftkit.errors import CorruptCheckpointError, FormatError, StorageError
from ftkit.format.data import read_tensors, verify
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.reader import load_manifest
from ftkit.format.validate import ZSTD_MAX_RATIO

ITERATIONS = int(__import__("os").environ.get("FTKIT_FUZZ_ITERATIONS", "150"))


def _build(root, world_size: int, compress: str | None):
    """A real checkpoint of a model, optimizer, bf16 and 2-D tensors, resharded to
    `world_size` ranks by the CLI so the manifest has several files and shards."""
    state = make_state(0, width=64)
    state["bf16"] = torch.randn(33, 7).to(torch.bfloat16)
    state["grid"] = torch.arange(600, dtype=torch.int64).reshape(20, 30)
    state["zeros"] = torch.zeros(5000)
    src = root.parent / f"{root.name}-src"
    with ftkit.Checkpointer(state, [ftkit.Tier(str(src), compress=compress)]) as ck:
        ck.snapshot(1)
    r = run_cli("restore", str(src), "--out", str(root), "--world-size", str(world_size))
    assert r.returncode == 0, r.stderr
    storage = ftkit.Tier(str(root)).open()
    original = load_manifest(storage, 1)
    return storage, original, read_tensors(storage, original)


def _paths(doc, at=()):
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, at + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, at + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _set(doc, path, value):
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _mutate(doc, rng: random.Random, strings: list[str]):
    """One random mutation of `doc` (a copy); returns (doc, description)."""
    doc = copy.deepcopy(doc)
    paths = list(_paths(doc))
    path = rng.choice(paths[1:])
    value = _get(doc, path)
    choices = ["replace"]
    if isinstance(value, list):
        choices += ["drop", "dup", "empty", "swap"]
    if isinstance(value, dict):
        choices += ["del_key", "add_key", "rename_key"]
    if isinstance(value, int) and not isinstance(value, bool):
        choices += ["nudge", "nudge", "scale"]
    if isinstance(value, str):
        choices += ["other_string", "other_string"]
    how = rng.choice(choices)
    if how == "replace":
        new = rng.choice(
            [
                None,
                True,
                False,
                -1,
                0,
                1,
                7,
                2**31,
                2**63,
                2**70,
                0.5,
                "__INF__",
                "__BIGINT__",
                "__HUGEINT__",
                "\u00b2",
                "",
                "../x",
                "a" * 300,
                [],
                {},
                {"$tensor": "nope"},
                [0, 0],
                {"bytes": 1},
                rng.randint(-10, 10**6),
            ]
        )
        doc = _set(doc, path, new)
    elif how == "drop" and value:
        value.pop(rng.randrange(len(value)))
    elif how == "dup" and value:
        value.append(copy.deepcopy(rng.choice(value)))
    elif how == "empty":
        value.clear()
    elif how == "swap" and len(value) > 1:
        i, j = rng.sample(range(len(value)), 2)
        value[i], value[j] = value[j], value[i]
    elif how == "del_key" and value:
        value.pop(rng.choice(list(value)))
    elif how == "add_key":
        value[rng.choice(["$tensor", "$items", "extra", "bytes", "chunks"])] = rng.choice([1, "x", [], None])
    elif how == "rename_key" and value:
        key = rng.choice(list(value))
        value[rng.choice(["\u00b2", "-1", "01", "1" * 40, "$tensor", ""])] = value.pop(key)
    elif how == "nudge":
        doc = _set(doc, path, value + rng.choice([-1, 1, -64, 64, 4096]))
    elif how == "scale":
        doc = _set(doc, path, rng.choice([value * 2, value // 2, -value, value * 10**9]))
    elif how == "other_string":
        doc = _set(doc, path, rng.choice(strings))
    return doc, f"{how} at {'/'.join(map(str, path))}"


def _raw_numbers(text: str) -> str:
    """What json.dumps cannot write: a float that overflows, integers Python will not convert."""
    return (
        text.replace('"__INF__"', "1e400").replace('"__BIGINT__"', "1" * 5000).replace('"__HUGEINT__"', "1" + "0" * 400)
    )


def _strings(doc) -> list[str]:
    out = set()
    for p in _paths(doc):
        v = _get(doc, p)
        if isinstance(v, str):
            out.add(v)
    return sorted(out) + ["float64", "int8", "bool", "zstd", "raw", "sharded", "rank-local"]


@pytest.mark.parametrize("world_size, compress, seed", [(1, None, 1), (3, None, 2), (2, "zstd", 3)])
def test_random_mutations_never_crash_and_never_verify_garbage(tmp_path, world_size, compress, seed):
    root = tmp_path / "ckpt"
    storage, original, values = _build(root, world_size, compress)
    path = root / step_dir_name(1) / MANIFEST_NAME
    pristine = {f: f.read_bytes() for f in path.parent.glob("*.json")}
    doc0 = manifest_doc(path)  # index and part as one document: mutations reach every field
    strings = _strings(doc0)
    stored = sum(f.stat().st_size for f in path.parent.glob("*.data"))
    bound = stored * (ZSTD_MAX_RATIO if compress else 1)
    untouched_entries = {t.name: t for t in original.tensors}
    rng = random.Random(seed)
    verified_ok = 0
    for i in range(ITERATIONS):
        doc, what = _mutate(doc0, rng, strings)
        write_manifest_doc(path, doc, _raw_numbers)  # the part rehashed
        ctx = f"seed {seed} iteration {i}: {what}"
        m = _load_or_none(storage, ctx)
        r = run_cli("verify", str(root))
        assert r.returncode in (0, 1) and "Traceback" not in r.stdout + r.stderr, f"{ctx}: {r.stdout}{r.stderr}"
        if m is None:
            assert r.returncode == 1, f"{ctx}: verify accepted what the parser refused"
            continue
        try:
            verify(storage, m)
        except (CorruptCheckpointError, StorageError):
            assert r.returncode == 1, ctx
            continue
        assert r.returncode == 0, f"{ctx}: the CLI disagrees with the library: {r.stdout}"
        verified_ok += 1
        got = read_tensors(storage, m)
        allocated = 0
        for t in m.tensors:
            x = got[t.name]
            assert tuple(x.shape) == t.shape and str(x.dtype) == f"torch.{t.dtype}", ctx
            allocated += x.numel() * x.element_size()
            if untouched_entries.get(t.name) == t:
                assert torch.equal(x, values[t.name]), f"{ctx}: {t.name} changed"
        assert allocated <= bound, f"{ctx}: {allocated} bytes allocated for {stored} stored"
    _restore_files(path, pristine)
    assert run_cli("verify", str(root)).returncode == 0
    assert verified_ok > 10  # the mutations that keep a manifest valid (names, times, writer...) ran through


def _load_or_none(storage, ctx: str):
    """The step's manifest, None when it is refused; anything but FormatError fails the test."""
    try:
        return load_manifest(storage, 1)
    except FormatError:
        return None
    except Exception as e:  # noqa: BLE001 - the property under test
        pytest.fail(f"{ctx}: loading raised {type(e).__name__}: {e}")


def _restore_files(path, pristine) -> None:
    for f in path.parent.glob("part-*.json"):
        f.unlink()
    for f, data in pristine.items():
        f.write_bytes(data)


def test_random_mutations_of_the_index_and_its_part_as_written(tmp_path):
    """The index and its part as they lie on disk, mutated without rehashing: a changed part
    fails its checksum, a changed index entry (name, size, checksum, ranks) names no
    valid part. Nothing crashes; what still loads holds exactly the saved values."""
    root = tmp_path / "ckpt"
    storage, original, values = _build(root, 3, None)
    path = root / step_dir_name(1) / MANIFEST_NAME
    pristine = {f: f.read_bytes() for f in path.parent.glob("*.json")}
    index = json.loads(pristine[path])
    (part_path,) = [f for f in pristine if f != path]
    pair = {"index": index, "part": [json.loads(line) for line in pristine[part_path].splitlines()]}  # its 3 lines
    rng, strings = random.Random(4), _strings(pair)
    rejected = 0
    for i in range(max(ITERATIONS // 3, 20)):
        doc, what = _mutate(pair, rng, strings)
        ctx = f"iteration {i}: {what}"
        if not isinstance(doc, dict) or not isinstance(doc.get("index"), dict) or "part" not in doc:
            continue
        path.write_text(_raw_numbers(json.dumps(doc["index"])))
        part = doc["part"]
        lines = [json.dumps(x) for x in part] if isinstance(part, list) else [json.dumps(part)]
        part_path.write_text(_raw_numbers("\n".join(lines) + "\n"))
        m = _load_or_none(storage, ctx)
        r = run_cli("verify", str(root))
        assert r.returncode == (1 if m is None else 0), f"{ctx}: {r.stdout}{r.stderr}"
        assert "Traceback" not in r.stdout + r.stderr, ctx
        rejected += m is None
        if m is not None:
            got = read_tensors(storage, m)
            assert all(torch.equal(got[t.name], values[t.name]) for t in original.tensors), ctx
    _restore_files(path, pristine)
    assert rejected > 0 and run_cli("verify", str(root)).returncode == 0


def test_random_mutations_never_reach_the_live_state(tmp_path):
    """A restore over a mutated step 2 (skeleton, parts, rank state, index: every field, the
    part rehashed) either loads a step whole, or changes nothing: it never raises anything
    but an FtkitError, never leaves a live key holding another kind of thing, loads step 1
    exactly when it falls back, and leaves the live state byte for byte as it was when it
    gives up; the process's memory does not grow on a manifest's word."""
    import resource

    from livestate import fingerprint, live_state, values

    from ftkit.errors import FtkitError
    from ftkit.save.capture import entry_kind

    root = tmp_path / "ckpt"
    state = live_state(1)
    refs = {}
    with ftkit.Checkpointer(state, [ftkit.Tier(str(root), keep=5)]) as ck:
        for step in (1, 2):
            state["w"].add_(1.0)
            state["epoch"] += 1
            ck.snapshot(step)
            ck.wait()
            refs[step] = values(state)
    path = root / step_dir_name(2) / MANIFEST_NAME
    pristine = {f: f.read_bytes() for f in path.parent.glob("*.json")}
    doc0 = manifest_doc(path)
    rng, strings = random.Random(5), _strings(doc0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: dict[str, int] = {}
    for i in range(max(ITERATIONS // 2, 40)):
        doc, what = _mutate(doc0, rng, strings)
        write_manifest_doc(path, doc, _raw_numbers)
        ctx = f"iteration {i}: {what}"
        live = live_state(7)
        kinds = {k: (entry_kind(v), type(v) if entry_kind(v) != "value" else None) for k, v in live.items()}
        objects = {k: id(v) for k, v in live.items() if entry_kind(v) != "value"}
        before = fingerprint(live)
        try:
            with ftkit.Checkpointer(live, [str(root)]) as ck:
                step = ck.restore()
        except FtkitError:
            assert fingerprint(live) == before, f"{ctx}: a failed restore changed the live state"
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            _restore_files(path, pristine)
            continue
        except Exception as e:  # noqa: BLE001 - the property under test
            pytest.fail(f"{ctx}: restore raised {type(e).__name__}: {e}")
        got = {k: (entry_kind(v), type(v) if entry_kind(v) != "value" else None) for k, v in live.items()}
        assert got == kinds, f"{ctx}: a live entry changed kind: {kinds} -> {got}"
        assert {k: id(v) for k, v in live.items() if entry_kind(v) != "value"} == objects, ctx
        assert step in (1, 2), ctx
        if step == 1:
            from livestate import equal

            assert equal(values(live), refs[1]), f"{ctx}: step 1 did not load whole"
        outcomes[str(step)] = outcomes.get(str(step), 0) + 1
        _restore_files(path, pristine)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert grown < 300_000, f"peak memory grew by {grown} KiB over the run"
    assert outcomes.get("1", 0) > 0 and outcomes.get("2", 0) > 0, outcomes


def test_random_store_messages_are_refused_or_skipped_never_raised():
    """Inventories, candidates and fetch requests as rank 0 reads them from the store, mutated:
    an inventory (a typed message, its bytes flipped, cut or grown) decodes to names that stay
    in their step directory or is a FormatError; a candidate is a FormatError; the planner
    skips what is malformed; nothing else escapes."""
    from ftkit.commit.messages import Held, Inventory
    from ftkit.format.validate import parse_message
    from ftkit.restore.plan import Candidate, ram_candidates
    from ftkit.restore.read import _request

    inventory = Inventory(
        (
            Held(3, ("rank-00000-0a0b0c0d.data", "part-00000-01020304.json"), ("rank-00000-0a0b0c0d.data",)),
            Held(2, ("rank-00000-1a0b0c0d.data",), None, None, "xxh3_64:0123456789abcdef", ()),
            Held(1, ("rank-00000-2a0b0c0d.data",), problem="CorruptCheckpointError: manifest.json: not JSON"),
        )
    ).encode()
    problem = Inventory.decode(inventory, "an inventory").steps[2].problem
    assert problem == "CorruptCheckpointError: manifest.json: not JSON"
    candidate = Candidate(3, 0, {"rank-00000-0a0b0c0d.data": (0, 1)}, 1, {"part-00000-01020304.json": 0}).to_json()
    request = {"missing": ["rank-00000-0a0b0c0d.data"], "mismatch": False}
    message = {"candidate": candidate, "request": request}
    rng, strings = random.Random(6), _strings(message) + ["part-/../../x.json", "../x.data", "\u00b2"]
    for i in range(ITERATIONS * 4):
        doc, what = _mutate(message, rng, strings)
        raw = _raw_numbers(json.dumps(doc)).encode()
        ctx = f"iteration {i}: {what}"
        parsed = parse_message(raw)
        inv_bytes = _mutate_bytes(inventory, rng)
        try:
            try:
                inv = Inventory.decode(inv_bytes, "a mutated inventory")
            except FormatError:
                inv = None
            plan = ram_candidates([inv, inv], ["a", "b"], 0, True)
            for cand in plan.values():
                assert all(".." not in f and "/" not in f for f in [*cand.holders, *cand.part_holders]), ctx
            part = parsed if isinstance(parsed, dict) else {}
            assert all(".." not in f for f in _request(part.get("request")).get("missing", [])), ctx
            try:
                Candidate.from_json(part.get("candidate"))
            except FormatError:
                pass
        except Exception as e:  # noqa: BLE001 - the property under test
            pytest.fail(f"{ctx}: {type(e).__name__}: {e}")


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """`data` with a few bytes flipped, or cut short, or grown, or a name swapped for another."""
    b = bytearray(data)
    how = rng.randrange(4)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif how == 1:
        del b[rng.randrange(len(b)) :]
    elif how == 2:
        b[rng.randrange(len(b)) : rng.randrange(len(b))] = rng.randbytes(rng.randint(1, 16))
    else:
        b = bytearray(bytes(b).replace(b"rank-00000-0a0b0c0d.data", rng.choice([b"../../x.data", b"a/b", b"\xc3"])))
    return bytes(b)
