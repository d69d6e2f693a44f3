#!/usr/bin/env python3
"""Run a local SeaweedFS S3 server in the foreground: see ftkit/drill/s3server.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.drill.s3server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
