"""The RAM tier's index (commit/ram.py): rank 0's commit of a step from every node's
record, and the copies the nodes holding rank 0's replicas keep.

Order of calls for one step: `commit_from_records` on rank 0 once every node's collector has
set its record (it writes manifest.json, the commit, and, with replicas, sets the index in
the store for the holders); `write_index_copy` on the exchanger of each node that
`holds_index`, after its own share of the step. The index lives where rank 0's data
lives: losing all those nodes loses rank 0's share of the step, so the step anyway.
"""

from __future__ import annotations

from typing import Any

from ftkit.commit.keys import KeyLedger, delete_keys
from ftkit.commit.manifests import Committed, check_files_present, commit_index
from ftkit.commit.shared import NodeGroup, read_node_record
from ftkit.coord.dist import DistContext
from ftkit.errors import FormatError, StorageError
from ftkit.format.index import INDEX_VERSION, parse_index
from ftkit.format.manifest import MANIFEST_NAME, step_dir_name
from ftkit.format.validate import parse_header
from ftkit.save.write import discard
from ftkit.tiers.peers import ReplicaLayout
from ftkit.tiers.storage import Storage


def holds_index(ctx: DistContext, layout: ReplicaLayout | None, replicas: int) -> bool:
    """Whether this rank's node keeps the RAM tier's index: rank 0's node, and the nodes
    that hold its replicas (`layout`, `replicas`: the tier's, when it exchanges them)."""
    if not ctx.distributed or ctx.node == ctx.nodes[0]:
        return True
    return layout is not None and replicas > 0 and ctx.node in layout.target_nodes(0, ctx.nodes, replicas)


def commit_from_records(
    storage: Storage,
    step: int,
    skeleton: dict[str, Any],
    ctx: DistContext,
    key: str,
    group: NodeGroup,
    mine: tuple[dict[str, Any], list[str]] | None,
    older: list,
    ledger: KeyLedger | None,
    at: tuple[int, int],
    exchange: bool,
    own_errors: list[str] | None = None,
) -> Committed:
    """Rank 0: every node's record, the index, and the word to the index holders. `mine`: its
    own node's record and the files the step put there, where rank 0 collects its node (a
    job of one node); else that node's record comes through the store like the others', and
    `own_errors` are rank 0's own (its replication's), which that record leaves out."""
    ids = list(group.record_ids)
    keys = [f"{key}/r/{n}" for n in ids]
    records = [mine[0]] if mine is not None else []
    own: dict[str, Any] | None = records[0] if records else None  # rank 0's node's record
    try:
        try:
            raws = ctx.wait_get(keys) if keys else []
        except Exception as e:  # a node never answered: the step is not committed
            raise StorageError(f"step {step} not committed to the RAM tier: {e}") from None
        for n, raw in zip(ids, raws, strict=True):
            records.append(read_node_record(n, raw, group.members[n], ctx.world_size))
            if n == 0:
                own = records[-1]
        if not any(r["skipped"] for r in records):  # nobody reads the older keys any more
            delete_keys(ctx, older)
        failures = [e for r in records for e in r["errors"]] + (own_errors or [])
        if failures:
            raise StorageError(f"step {step} not committed to the RAM tier: {'; '.join(failures)}")
        assert own is not None
        local = {own["part"]["file"], *own.get("others", [])}  # the parts in rank 0's node's directory
        committed = commit_index(storage, step, ctx.world_size, records, skeleton, local_parts=local)
    except BaseException:
        discard(storage, step, mine[1] if mine is not None else _files_of(own))
        if exchange:  # the index holders wait for no index
            ctx.put(f"{key}/manifest", "")
            _record_manifest(ledger, at, key)
        raise
    finally:
        ctx.delete(*keys, *(f"{key}/w/{n}" for n in group.members if exchange))
    if exchange:  # to the nodes that hold rank 0's replicas (holds_index)
        ctx.store.set(f"{key}/manifest", committed.manifest_json)
        _record_manifest(ledger, at, key)
    return committed


def _files_of(record: dict[str, Any] | None) -> list[str]:
    """What a node's record says the step put in its directory (a failed commit removes it)."""
    if record is None:
        return []
    return [*record["files"], *([record["part"]["file"]] if record["part"] else []), *record.get("others", [])]


def _record_manifest(ledger: KeyLedger | None, at: tuple[int, int], key: str) -> None:
    if ledger is not None:  # deleted after the next step's records: every index holder has read it then
        ledger.record_key(at, f"{key}/manifest")


def write_index_copy(storage: Storage, step: int, ctx: DistContext, key: str, written: dict[str, Any] | None) -> None:
    """An index holder's exchanger writes rank 0's index into its node's directory, once it has
    checked that the index names its node's part as its leader wrote it (`written`:
    store_part's record) and the node's files are in place."""
    data = ctx.get_raw(f"{key}/manifest")
    if data in (b"", b'""'):  # rank 0's "not committed" (put as JSON "")
        discard(storage, step, [name for name, _ in storage.list_dir(step_dir_name(step))])
        raise StorageError(f"step {step} was not committed to the RAM tier (rank 0 gave up)")
    where = f"the index of step {step} from rank 0"
    doc, version = parse_header(data, where)
    if version != INDEX_VERSION:
        raise FormatError(f"{where} has format version {version}, not {INDEX_VERSION}")
    index = parse_index(doc, where, expect_step=step)
    mine = written["part"] if written else None
    if mine is None or not any(p.file == mine["file"] and p.checksum == mine["checksum"] for p in index.parts):
        raise StorageError(f"step {step}: {where} does not name this node's part")
    check_files_present(storage, step, {**written["files"], mine["file"]: mine["bytes"]})  # type: ignore[index]
    storage.write_bytes_atomic(f"{step_dir_name(step)}/{MANIFEST_NAME}", data)
