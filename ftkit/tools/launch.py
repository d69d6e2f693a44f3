"""Deprecated alias of ``python -m ftkit.runtime.launch``, ``ftkit run``'s worker launcher."""

import warnings

from ftkit.runtime.launch import main

# A DeprecationWarning is shown by default only when it names __main__ (as it does run with -m).
warnings.warn(
    "ftkit.tools.launch is deprecated: it is ftkit.runtime.launch now",
    DeprecationWarning,
    stacklevel=1 if __name__ == "__main__" else 2,
)

if __name__ == "__main__":
    main()
