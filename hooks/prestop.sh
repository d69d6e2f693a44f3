#!/bin/sh
# Ask the training job in this container to save and stop, and wait for it.
#
#   prestop.sh [DEADLINE_SECONDS]
#
# Sends SIGTERM to torchrun (which forwards it to the workers: ftkit saves the
# current step to every tier, then they exit) and waits until no worker is left
# or the deadline passes. Used as a Kubernetes preStop hook; works anywhere.
deadline=${1:-120}
pids=$(pgrep -f "torch.distributed.run|torchrun" || true)
[ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null || true
waited=0
while [ "$waited" -lt "$deadline" ]; do
    pgrep -f "torch.distributed.run|torchrun" >/dev/null 2>&1 || exit 0
    sleep 1
    waited=$((waited + 1))
done
echo "prestop: training still running after ${deadline}s" >&2
exit 1
