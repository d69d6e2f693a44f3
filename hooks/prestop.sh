#!/bin/sh
# Ask the training job in this container to save and stop, and wait for it.
#
#   prestop.sh [DEADLINE_SECONDS]
#
# Sends SIGTERM to `ftkit run` (or to a plain torchrun), which passes it to the
# workers: ftkit saves the current step to every tier, then they exit. Waits until
# the job has exited or the deadline passes. Used as a Kubernetes preStop hook;
# works anywhere.
deadline=${1:-120}
# The launcher's own command line only: `[python [-opts]] [.../]ftkit run ...` (-X and
# -W take their value as the next word),
# `[.../]torchrun ...` or `python -m torch.distributed.run ...`; not its agent or
# workers (signalled through it), nor a process that merely names torchrun in an
# argument (a drill zygote's --preload).
job='^([^ ]*python[^ ]*( -[XW] [^ ]+| -[^ ]+)* )?(([^ ]*/)?(ftkit run|torchrun)|torch\.distributed\.run)( |$)'
pids=$(pgrep -f "$job" || true)
[ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null || true
waited=0
while [ "$waited" -lt "$deadline" ]; do
    pgrep -f "$job" >/dev/null 2>&1 || exit 0
    sleep 1
    waited=$((waited + 1))
done
echo "prestop: training still running after ${deadline}s" >&2
exit 1
