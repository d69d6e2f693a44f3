"""Trainer integrations: one callback that snapshots and resumes through ftkit.

* :mod:`ftkit.integrations.lightning`: ``FtkitCallback`` for a PyTorch Lightning ``Trainer``.
* :mod:`ftkit.integrations.huggingface`: ``FtkitCallback`` for a ``transformers.Trainer``.

Each module imports its framework on import; this package imports neither.
"""
