"""gc and a job's retention abort only ftkit's own incomplete uploads (issue 35, item 5).

A tier's prefix may be shared: another job's uploads below a sibling prefix that shares
its string prefix, a backup written below the tier, a database dump in the same bucket
when the tier is the bucket's root. Those are reported by `ftkit ls`, never aborted.
And what one upload is made of. Against the real S3 server (tests/support/s3fixture.py).
"""

from __future__ import annotations

import json
import uuid

import torch
from conftest import run_cli

import ftkit
from ftkit.format.manifest import step_dir_name
from ftkit.tiers import retention
from ftkit.tiers.storage import Storage

OWN = f"{step_dir_name(2)}/rank-00000-0badf00d.data"  # what a writer killed mid-upload of step 2 leaves


def _start_upload(storage: Storage, path: str) -> str:
    """Begin a multipart upload of `path` ("bucket/key") with one part, never completed."""
    bucket, _, key = path.partition("/")
    upload = storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    storage.fs.call_s3(
        "upload_part", Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    return key


def _pending(storage: Storage, bucket: str) -> set[str]:
    """Keys with an incomplete upload anywhere in `bucket`, asked of the server itself."""
    return {u["Key"] for u in storage.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") or []}


def _committed_tier(url: str, opts: dict) -> Storage:
    with ftkit.Checkpointer({"w": torch.zeros(64)}, [ftkit.Tier(url, storage_options=opts)], rng=False) as ck:
        ck.snapshot(1)
    return Storage(url, opts)


def _gc(url: str, opts: dict, *extra: str) -> dict:
    r = run_cli(
        "gc", url, "--keep", "1", "--grace", "0", "--storage-options", json.dumps(opts), "--json", *extra, env={}
    )  # (env: a subprocess, as a user's shell runs it)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    return json.loads(r.stdout)


def _ls(url: str, opts: dict) -> dict:
    r = run_cli("ls", url, "--storage-options", json.dumps(opts), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_gc_aborts_its_own_stale_upload_and_leaves_other_writers_alone(s3_server, s3_url):
    opts = s3_server.storage_options()
    storage = _committed_tier(s3_url, opts)
    bucket = storage.root.partition("/")[0]
    own = _start_upload(storage, storage.path(OWN))
    sibling = _start_upload(storage, f"{storage.root}0/{step_dir_name(1)}/rank-00000-deadbeef.data")  # run1 vs run10
    backup = _start_upload(storage, storage.path("backups/db.dump"))  # below the tier, not a step's file

    listed = _ls(s3_url, opts)
    assert [u["key"] for u in listed["incomplete_uploads"]] == [own]
    assert [u["key"] for u in listed["foreign_uploads"]] == [backup]
    human = run_cli("ls", s3_url, "--storage-options", json.dumps(opts))
    assert "1 foreign incomplete upload(s)" in human.stdout and backup in human.stdout, human.stdout

    out = _gc(s3_url, opts, "--dry-run")
    assert out["aborted_uploads"] == [own] and out["foreign_uploads"] == 1
    assert {own, sibling, backup} <= _pending(storage, bucket)  # a dry run touches nothing
    human = run_cli("gc", s3_url, "--keep", "1", "--grace", "0", "--dry-run", "--storage-options", json.dumps(opts))
    assert "left alone 1 incomplete upload(s) that are not ftkit's" in human.stdout, human.stdout

    out = _gc(s3_url, opts)
    assert out["aborted_uploads"] == [own] and out["foreign_uploads"] == 1 and out["errors"] == []
    pending = _pending(storage, bucket)
    assert own not in pending and {sibling, backup} <= pending
    assert out["kept"] == [1]


def test_gc_at_a_bucket_root_leaves_the_buckets_other_uploads_alone(s3_server):
    opts = s3_server.storage_options()
    bucket = f"ftkit-root-{uuid.uuid4().hex[:12]}"
    url = f"s3://{bucket}"
    storage = Storage(url, opts)
    storage.fs.call_s3("create_bucket", Bucket=bucket)
    own = _start_upload(storage, f"{bucket}/{OWN}")
    dump = _start_upload(storage, f"{bucket}/db/dump.sql")
    other_job = _start_upload(storage, f"{bucket}/run1/{OWN}")  # another tier's step file, not this one's

    listed = _ls(url, opts)
    assert [u["key"] for u in listed["incomplete_uploads"]] == [own]
    assert sorted(u["key"] for u in listed["foreign_uploads"]) == sorted([dump, other_job])

    out = _gc(url, opts)
    assert out["aborted_uploads"] == [own] and out["foreign_uploads"] == 2
    assert _pending(storage, bucket) == {dump, other_job}

    # Only foreign uploads left: no checkpoint here, and nothing is touched.
    r = run_cli("gc", url, "--keep", "1", "--grace", "0", "--storage-options", json.dumps(opts))
    assert r.returncode != 0 and "no checkpoint steps here" in r.stderr and "Traceback" not in r.stderr
    assert _pending(storage, bucket) == {dump, other_job}


def test_a_running_jobs_retention_aborts_only_its_own_uploads(s3_server, s3_url):
    opts = s3_server.storage_options()
    storage = _committed_tier(s3_url, opts)
    bucket = storage.root.partition("/")[0]
    own = _start_upload(storage, storage.path(OWN))
    sibling = _start_upload(storage, f"{storage.root}0/{step_dir_name(1)}/rank-00000-deadbeef.data")
    backup = _start_upload(storage, storage.path("backups/db.dump"))
    retention._uploads_checked.pop(storage.url, None)  # (a job looks at most hourly per tier)
    removed = retention.apply_job_retention(storage, keep=2, keep_every=None, protect=1, upload_grace_s=0)
    assert removed == []
    pending = _pending(storage, bucket)
    assert own not in pending and {sibling, backup} <= pending
    assert retention.abort_stale_uploads(storage, grace_s=0) == 0  # the foreign ones stay, every time
    assert {sibling, backup} <= _pending(storage, bucket)


def test_ls_and_gc_of_a_missing_bucket_say_so_in_one_line(s3_server):
    # A mistyped bucket: listing its objects finds nothing, and the incomplete-upload listing
    # that follows gets NoSuchBucket (FileNotFoundError from s3fs) -- a traceback before.
    opts = s3_server.storage_options()
    url = f"s3://ftkit-missing-{uuid.uuid4().hex[:12]}/run1"
    for args in (("ls", url), ("gc", url, "--keep", "1")):
        r = run_cli(*args, "--storage-options", json.dumps(opts))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert lines[0].startswith(f"ftkit: error: listing incomplete uploads of {url} failed: ")
        assert "bucket does not exist" in lines[0] and opts["secret"] not in lines[0]


def test_aborting_an_upload_that_is_gone_already_is_no_error(s3_server, s3_url):
    # gc lists an old upload, then another gc (or a job's hourly check) aborts it first: the
    # store answers NoSuchUpload, which must not end gc with a traceback.
    opts = s3_server.storage_options()
    storage = _committed_tier(s3_url, opts)
    key = _start_upload(storage, storage.path(OWN))
    storage.abort_upload({"key": key, "upload_id": "an-upload-id-the-store-no-longer-knows"})
    assert key in _pending(storage, storage.root.partition("/")[0])  # (a different upload: untouched)


def test_one_big_write_goes_up_in_64_mib_parts(s3_server, s3_url):
    """A rank's uncompressed image is one write(): s3fs sent it as one part of up to 5 GiB, so the
    deadline on each S3 request (tiers/backends.py) would have cut a healthy slow upload of it."""
    storage = Storage(s3_url, s3_server.storage_options())
    with storage.open_write("big.data") as f:
        f.write(bytes(64 * 2**20 + 1))
    bucket, _, key = storage.path("big.data").partition("/")
    etag = storage.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith("-2"), etag  # a multipart object's ETag: "<md5 of part md5s>-<parts>"
