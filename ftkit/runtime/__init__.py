"""The job runtime: how a training job starts, fails and comes back, apart from checkpointing.

run.py              ``ftkit run``: torchrun with ftkit's defaults, the zygote, the startup watch
supervise.py        its plan (torchrun's command line) and the startup watch
launch.py           the worker-side launcher (``python -m ftkit.runtime.launch``)
warm/               warm starts: the per-node zygote, the thin client, ftkit's torchrun agent
inprocess.py        ``ftkit.run_in_process``: a failed generation re-forms the group in place
generation.py       the torchrun attempt and in-process generation a process is in
verdict_actions.py  what a rank does on a watchdog verdict (end, relay, recover in process)

Nothing is imported here: ftkit/coord and the checkpointer import these modules one by one.
"""
