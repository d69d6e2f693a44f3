"""torchrun's launcher and elastic agent in a process forked from the zygote
(``zygote.torchrun_command``): ``torch.distributed.run``'s own ``main``, with one helper
of torch's replaced.

torch's dynamic rendezvous names the method behind each of its log records with
``inspect.stack()``, twice per record (``get_method_name``). That resolves the module of
every frame on the stack, and a frame without a module file (``<frozen runpy>``) makes
``inspect`` scan all of ``sys.modules``: in an interpreter that imported what a zygote
imports (torch._dynamo, FSDP, ftkit, the job's modules) a restart's rendezvous took
0.86 s against 0.24 s in a fresh one here. ``sys._getframe`` names the same frame
without the scan (tests/test_warm.py checks they agree).
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
