"""`python -m ftkit ...` is the `ftkit` command."""

import sys

from ftkit.tools.cli import main

sys.exit(main())
