"""torchrun's launcher and elastic agent, as ftkit starts it (``zygote.torchrun_command``):
``torch.distributed.run``'s own ``main``, with one helper of torch's replaced. ``ftkit run``
and a drill without a zygote run this file by path in a new interpreter (it imports no
ftkit); a drill or a test with a zygote forks it warm (``--module ftkit.warm.agent``).

torch's dynamic rendezvous names the method behind each of its log records with
``inspect.stack()``, twice per record (``get_method_name``). That resolves the module of
every frame on the stack, and a frame without a module file (``<frozen runpy>``) makes
``inspect`` scan all of ``sys.modules``: 23 ms a call in a new agent here (1,266 modules),
more in an interpreter that imported what a zygote imports (torch._dynamo, FSDP, ftkit,
the job's modules), where a restart's rendezvous took 0.86 s against 0.24 s in a fresh
one. ``sys._getframe`` names the same frame without the scan (tests/test_warm.py checks
they agree). A restart's teardown with it, `ftkit drill --cold --no-replace --faults
node@30:node=1,kill@70:rank=1 --steps 100 --step-time 0.05` (two runs each, four
restarts): 0.31-0.50 s against 0.42-0.86 s with torch's helper.
"""

from __future__ import annotations

import sys


def method_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up from this one, as torch's get_method_name."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def main() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = method_name
    from torch.distributed.run import main as torchrun

    torchrun()  # its arguments: sys.argv[1:], as `python -m torch.distributed.run` has them


if __name__ == "__main__":
    main()
