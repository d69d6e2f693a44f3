"""Operator tooling on top of the library: the `ftkit` command line (cli), export and
offline resharding, run reports and `ftkit gc` (`ftkit run` itself: ftkit/runtime)."""
