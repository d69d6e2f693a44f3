"""torchrun's launcher and elastic agent as ftkit starts it (``zygote.torchrun_command``):
``torch.distributed.run``'s own ``main`` with four changes. It imports no ftkit: run by path
in a new interpreter, or forked warm (``--module ftkit.runtime.warm.agent``).

* ``get_method_name`` uses ``sys._getframe``: torch's ``inspect.stack()`` scans all of
  ``sys.modules`` for a frame without a module file, twice per log record of the
  rendezvous (tests/processes/test_warm.py checks they agree).
* **Every round republishes the workers' store.** With the agent's TCP store shared
  (torch's default), torch builds the workers' bootstrap address in the first round only:
  a node that joins later waits forever for a MASTER_ADDR nobody writes, and a node that
  was rank 0 and no longer is hands its workers itself. Here rank 0 publishes its server's
  address in each round's store.
* **Workers learn the round** (``$FTKIT_RDZV_ROUND``): the same on every node, new at
  every round, also when a host joins or leaves without a failure (torchrun's restart count
  is not, and differs between agents). ftkit namespaces the store by it (generation.py).
* **A signal that stops the job is its exit status**, 128 + N (143 for SIGTERM), as the
  workers' own, not torch's ``SignalException`` traceback and exit 1 (hooks/README.md).
"""

from __future__ import annotations

import os
import sys


def method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one, as torch's get_method_name."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


ROUND_ENV = "FTKIT_RDZV_ROUND"  # generation.ROUND_ENV (this module imports no ftkit)


def patch_rendezvous(dynamic_rendezvous, api) -> bool:
    """Make DynamicRendezvousHandler.next_rendezvous republish the workers' store and export the
    round (module docstring). False, changing nothing, where torch's handler is not the expected one."""
    cls = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    original = getattr(cls, "next_rendezvous", None)
    if original is None or getattr(original, "_ftkit", False) or not hasattr(api, "RendezvousStoreInfo"):
        return False

    def next_rendezvous(self):
        info = original(self)
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        if state is not None:
            os.environ[ROUND_ENV] = str(state.round)
        server = getattr(self, "_shared_tcp_store_server", None)
        node = getattr(self, "_this_node", None)
        if os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1" or node is None:
            return info  # a new store per round, built by torch itself every time
        rank, store = info.rank, info.store
        if rank == 0 and server is None:
            return info
        fresh = api.RendezvousStoreInfo.build(
            rank, store, local_addr=node.addr, server_port=server.port if rank == 0 else None
        )
        self._bootstrap_store_info = fresh
        return api.RendezvousInfo(store, rank, info.world_size, fresh)

    next_rendezvous._ftkit = True  # type: ignore[attr-defined]
    setattr(cls, "next_rendezvous", next_rendezvous)  # noqa: B010 (cls: Any, checked above)
    return True


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = method_name
    patch_rendezvous(dynamic_rendezvous, api)
    from torch.distributed.run import main as torchrun

    try:
        torchrun()  # its arguments: sys.argv[1:], as `python -m torch.distributed.run` has them
    except SignalException as e:
        # A SIGTERM (a preemption) after the agent stopped its workers: the signal's exit
        # status, 128 + N, as the workers' own, not torch's traceback and exit 1.
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
