"""Incomplete multipart uploads on object stores: what a writer killed mid-upload leaves.

They are invisible to listings and billed, one per crash: `ftkit ls` reports them,
`ftkit gc` and a running job's retention abort old ones (tiers/retention.py).
Only backends with S3's multipart API have them (s3fs: `call_s3`); elsewhere there
are none.
"""

from __future__ import annotations

import time
from typing import Any


def list_incomplete_uploads(fs: Any, path: str) -> list[dict[str, Any]]:
    """{key, upload_id, initiated (Unix time)} of every upload begun below `path`
    ("bucket/prefix") and never completed; [] on backends without multipart uploads."""
    if not hasattr(fs, "call_s3"):
        return []
    bucket, _, prefix = path.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        for u in page.get("Uploads") or []:
            t = u.get("Initiated")
            initiated = t.timestamp() if hasattr(t, "timestamp") else time.time()
            out.append({"key": u["Key"], "upload_id": u["UploadId"], "initiated": initiated})
        if not page.get("IsTruncated"):
            return out
        kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))


def abort_upload(fs: Any, root: str, upload: dict[str, Any]) -> None:
    """Abort one upload from list_incomplete_uploads (`root`: any path in its bucket)."""
    bucket = root.partition("/")[0]
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["key"], UploadId=upload["upload_id"])
