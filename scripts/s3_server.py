#!/usr/bin/env python3
"""Run a local SeaweedFS S3 server (ftkit/drill/s3server.py) in the foreground.

    python scripts/s3_server.py [--data-dir DIR] [--bucket NAME] [--access-key K --secret-key S]

It prints the endpoint and the variables to export; Ctrl-C (or SIGTERM) stops it
and removes its temporary data directory.
"""

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ftkit.drill.s3server import DEFAULT_BUCKET, S3Server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a local SeaweedFS S3 server in the foreground.")
    parser.add_argument("--data-dir", help="persistent data dir (default: temp dir, removed on exit)")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET)
    parser.add_argument("--access-key")
    parser.add_argument("--secret-key")
    args = parser.parse_args(argv)

    # Let `kill <pid>` clean up like Ctrl-C does.
    def on_sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    srv = S3Server(args.data_dir, args.bucket, access_key=args.access_key, secret_key=args.secret_key)
    try:
        srv.start()
        print(f"S3 endpoint: {srv.endpoint_url}   bucket: {srv.bucket}")
        print(f"data dir: {srv.data_dir}   log: {srv.log_path}   startup: {srv.startup_seconds:.2f}s")
        print("export these to use it from s3fs/boto without storage_options:")
        for k, v in srv.env().items():
            print(f"export {k}={shlex.quote(v)}")
        print("Ctrl-C to stop.", flush=True)
        while srv.running:
            time.sleep(0.5)
        print(f"weed exited unexpectedly:\n{srv.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", file=sys.stderr)
        return 0
    finally:
        srv.stop()


if __name__ == "__main__":
    sys.exit(main())
