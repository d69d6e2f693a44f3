"""Warm starts: workers forked from a per-node zygote that has torch imported.

torchrun still starts, watches and restarts the workers, but each worker it starts is a
thin client (client.py, standard library only) that has the zygote (zygote.py) fork the
real worker, with everything imported, and stands in for it. ``ftkit run`` and ``ftkit
drill`` use it unless told ``--cold``.
"""
