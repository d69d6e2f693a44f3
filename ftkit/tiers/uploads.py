"""Incomplete multipart uploads on object stores: what a writer killed mid-upload leaves.

They are invisible to listings and billed, one per crash: `ftkit ls` reports them,
`ftkit gc` and a running job's retention abort old ones (tiers/retention.py).
Only backends with S3's multipart API have them (s3fs: `call_s3`); elsewhere there
are none.

A tier's prefix is not ftkit's alone: another job may write below a shared prefix,
and a tier at a bucket's root shares it with everything else in the bucket. So an
upload is ftkit's own (:func:`is_own_upload`) only when its key is exactly one of the
files ftkit writes into a step directory of this tier; every other upload is foreign:
reported, never aborted. This module is the one place that tells them apart.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ftkit.errors import StorageError
from ftkit.format.manifest import MANIFEST_NAME, STEP_DIR_RE

# A rank as the writers format it ({rank:05d}): five digits, or more without a leading zero.
_RANK = r"(?:\d{5}|[1-9]\d{5,7})"
# What ftkit uploads into a step directory, as each writer names it: data files
# (save/write.py; multipart through open_write past one 64 MiB block), per-node parts
# (format/index.py) and manifests (multipart through pipe_file past s3fs's 100 MiB). A
# retired manifest is a server-side copy, one request below 5 GB: never an upload of its own.
_OWN_FILE_RE = re.compile(
    rf"^(?:rank-{_RANK}-[0-9a-f]{{8}}\.data|part-{_RANK}-[0-9a-f]{{8}}\.json|{re.escape(MANIFEST_NAME)})$"
)


def is_own_upload(root: str, key: str) -> bool:
    """Whether the upload of `key` (bucket-relative) is ftkit's own on the tier at `root`
    ("bucket/prefix"): exactly `<prefix>/step-<12 digits>/<a file name ftkit writes>`."""
    prefix = root.partition("/")[2].strip("/")
    if prefix:
        if not key.startswith(prefix + "/"):
            return False  # (a sibling such as run10/ when the tier is run1)
        key = key[len(prefix) + 1 :]
    step_dir, sep, name = key.partition("/")
    return bool(sep) and STEP_DIR_RE.fullmatch(step_dir) is not None and _OWN_FILE_RE.fullmatch(name) is not None


def list_incomplete_uploads(fs: Any, root: str, rel: str = "") -> list[dict[str, Any]]:
    """{key, upload_id, initiated (Unix time), own} of every upload begun below `rel` of the
    tier at `root` ("bucket/prefix") and never completed; `own`: is_own_upload. [] on
    backends without multipart uploads."""
    if not hasattr(fs, "call_s3"):
        return []
    path = f"{root.rstrip('/')}/{rel}" if rel else root
    bucket, _, prefix = path.partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    out: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        for u in page.get("Uploads") or []:
            t = u.get("Initiated")
            initiated = t.timestamp() if hasattr(t, "timestamp") else time.time()
            own = is_own_upload(root, u["Key"])
            out.append({"key": u["Key"], "upload_id": u["UploadId"], "initiated": initiated, "own": own})
        if not page.get("IsTruncated"):
            return out
        kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))


def abort_upload(fs: Any, root: str, upload: dict[str, Any]) -> None:
    """Abort one of ftkit's own uploads on the tier at `root` (from list_incomplete_uploads).
    A foreign one is refused, whoever asks: it is someone else's data in flight."""
    if not is_own_upload(root, upload["key"]):
        raise StorageError(f"the upload of {upload['key']} is not ftkit's (not a step file of {root}); left alone")
    bucket = root.partition("/")[0]
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["key"], UploadId=upload["upload_id"])
