"""Incomplete multipart uploads (s3fs's `call_s3`): what a writer killed mid-upload leaves,
invisible to listings and billed. `ftkit ls` reports them; `ftkit gc` and retention abort old ones.

A tier's prefix may be shared with other writers, so an upload is ftkit's own
(:func:`is_own_upload`, the one place that decides) only when its key is exactly a file
ftkit writes into a step directory of this tier; any other is reported, never aborted.
"""

from __future__ import annotations

import re
import time
from typing import Any

from ftkit.errors import StorageError
from ftkit.format.manifest import MANIFEST_NAME, STEP_DIR_RE

# A rank as the writers format it ({rank:05d}): five digits, or more without a leading zero.
_RANK = r"(?:\d{5}|[1-9]\d{5,7})"
# What ftkit uploads into a step directory: data files (save/write.py), per-node parts
# (format/index.py) and manifests. A retired manifest is a server-side copy, not an upload.
_OWN_FILE_RE = re.compile(
    rf"^(?:rank-{_RANK}-[0-9a-f]{{8}}\.data|part-{_RANK}-[0-9a-f]{{8}}\.json|{re.escape(MANIFEST_NAME)})$"
)


def is_own_upload(root: str, key: str) -> bool:
    """Whether bucket-relative `key` is `<prefix>/step-<12 digits>/<a file ftkit writes>` of `root`."""
    prefix = root.partition("/")[2].strip("/")
    if prefix:
        if not key.startswith(prefix + "/"):
            return False  # (a sibling such as run10/ when the tier is run1)
        key = key[len(prefix) + 1 :]
    step_dir, sep, name = key.partition("/")
    return bool(sep) and STEP_DIR_RE.fullmatch(step_dir) is not None and _OWN_FILE_RE.fullmatch(name) is not None


def list_incomplete_uploads(fs: Any, root: str, rel: str = "") -> list[dict[str, Any]]:
    """{key, upload_id, initiated (Unix time), own} of every incomplete upload below `rel` of the
    tier at `root` ("bucket/prefix"); [] on backends without multipart uploads."""
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
    """Abort one of ftkit's own uploads on the tier at `root`; a foreign one is refused (StorageError)."""
    if not is_own_upload(root, upload["key"]):
        raise StorageError(f"the upload of {upload['key']} is not ftkit's (not a step file of {root}); left alone")
    bucket = root.partition("/")[0]
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["key"], UploadId=upload["upload_id"])
