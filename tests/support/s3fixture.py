"""pytest plugin: a real local S3 server (SeaweedFS ``weed mini``) per session.

Load it from a conftest with ``pytest_plugins = ["tests.support.s3fixture"]``.

Fixtures:
    s3_server  (session)  the running ``ftkit.drill.s3server.S3Server``; use its
                          ``storage_options()`` / ``env()`` / ``endpoint_url``.
    s3_url     (function) a fresh, unique ``s3://<bucket>/<uuid>`` prefix.

A missing ``weed`` binary fails the tests instead of skipping them: the S3
path is part of what this project must verify.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from ftkit.drill.s3server import S3Server, find_weed  # noqa: E402


@pytest.fixture(scope="session")
def s3_server():
    try:
        find_weed()
        missing = None
    except FileNotFoundError as e:
        missing = str(e)
    if missing:  # fail outside the except block: no chained traceback noise
        pytest.fail(missing, pytrace=False)
    # Default: a private temp data dir, deleted again by stop().
    server = S3Server()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server):
    yield s3_server.url(uuid.uuid4().hex)
