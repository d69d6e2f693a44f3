"""Warm starts: workers forked from a per-node zygote that has torch imported.

A torchrun restart used to start every worker as a new interpreter that
imports torch (2.5 s of CPU here) and, at its first ``optimizer.step()``,
``torch._dynamo`` (2.4 s more): 20 s of CPU for a 4-rank node on 2 cores. With
a warm start torchrun still starts, watches and restarts the workers, but each
worker it starts is a thin client (client.py, standard library only) that has
the zygote (zygote.py) fork the real worker, with everything imported, and
stands in for it. ``ftkit run`` and ``ftkit drill`` use it unless told
``--cold``.
"""
