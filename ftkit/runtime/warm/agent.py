"""torchrun's launcher and elastic agent, as ftkit starts it (``zygote.torchrun_command``):
``torch.distributed.run``'s own ``main``, with one helper of torch's replaced. ``ftkit run``
and a drill without a zygote run this file by path in a new interpreter (it imports no
ftkit); a drill or a test with a zygote forks it warm (``--module ftkit.runtime.warm.agent``).

torch's dynamic rendezvous names the method behind each of its log records with
``inspect.stack()``, twice per record (``get_method_name``). That resolves the module of
every frame on the stack, and a frame without a module file (``<frozen runpy>``) makes
``inspect`` scan all of ``sys.modules``: 23 ms a call in a new agent here (1,266 modules),
more in an interpreter that imported what a zygote imports (torch._dynamo, FSDP, ftkit,
the job's modules), where a restart's rendezvous took 0.86 s against 0.24 s in a fresh
one. ``sys._getframe`` names the same frame without the scan (tests/processes/test_warm.py checks
they agree). A restart's teardown with it, `ftkit drill --cold --no-replace --faults
node@30:node=1,kill@70:rank=1 --steps 100 --step-time 0.05` (two runs each, four
restarts): 0.31-0.50 s against 0.42-0.86 s with torch's helper.

Two more changes make torchrun's dynamic rendezvous (c10d, etcd-v2) hold across hosts that
come and go (issue 36, measured with emulated hosts: ftkit/drill/hosts.py):

* **Every round republishes the workers' store.** With the agent's TCP store shared (torch's
  default), torch builds the workers' bootstrap address once, in the first round, and reuses
  it: a node that joins later waits forever for a MASTER_ADDR nobody writes into the new
  round ("wait timeout ... torchelastic/role_info"), and a node that was rank 0 and no longer
  is hands its workers itself as MASTER_ADDR. Here each round rebuilds it: rank 0 publishes
  its server's address in the round's store, every other node reads it.
* **Workers learn the round** (``$FTKIT_RDZV_ROUND``): the same number on every node of a
  round, which grows with every round, also when a host joins or leaves without a failure
  (torchrun's restart count does not, and differs between agents). ftkit namespaces the
  store and counts attempts by it (coord/dist.py ``attempt``).
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


ROUND_ENV = "FTKIT_RDZV_ROUND"


def patch_rendezvous(dynamic_rendezvous, api) -> bool:
    """Make DynamicRendezvousHandler.next_rendezvous republish the workers' store address in
    every round and export the round (module docstring). False where torch's handler is not
    the one this was written against (nothing is changed then)."""
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
    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = method_name
    patch_rendezvous(dynamic_rendezvous, api)
    from torch.distributed.run import main as torchrun

    torchrun()  # its arguments: sys.argv[1:], as `python -m torch.distributed.run` has them


if __name__ == "__main__":
    main()
