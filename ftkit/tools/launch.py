"""Deprecated: ``python -m ftkit.tools.launch`` is ``python -m ftkit.runtime.launch`` now (``ftkit run``'s
worker launcher, which docs/operations.md showed at this path)."""

import warnings

from ftkit.runtime.launch import main

# Run with -m, this module is __main__, and a DeprecationWarning is shown by default only when it names __main__.
warnings.warn(
    "ftkit.tools.launch is deprecated: it is ftkit.runtime.launch now",
    DeprecationWarning,
    stacklevel=1 if __name__ == "__main__" else 2,
)

if __name__ == "__main__":
    main()
