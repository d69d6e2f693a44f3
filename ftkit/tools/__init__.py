"""Operator tooling on top of the library: the `ftkit` command line (cli), export and
offline resharding, run reports, `ftkit gc`, and `ftkit run`'s launcher and supervisor."""
