"""Trainer integrations: one ``FtkitCallback`` each for PyTorch Lightning
(:mod:`ftkit.integrations.lightning`) and ``transformers.Trainer``
(:mod:`ftkit.integrations.huggingface`). Each module imports its framework; this package neither."""
