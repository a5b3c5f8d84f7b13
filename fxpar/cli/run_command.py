"""`fxpar run [torchrun options] script.py [script args]`: a thin wrapper over torch.distributed.run (torchrun).

fxpar has no launcher of its own: this only sets one thread per rank by default (CPU ranks on one machine
otherwise oversubscribe the cores) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (restarted workers otherwise can read
the previous attempt's addresses from the rendezvous store they share with the agent and fail to connect:
pytorch/pytorch#135712), and hands everything else to torchrun unchanged.
"""
from __future__ import annotations

import argparse
import os


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="launch a script on every rank with torchrun",
                       description=__doc__.splitlines()[0])
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, help="torchrun's own arguments, then the script")
    p.set_defaults(func=run)


def run(args) -> int:
    return torchrun(args.torchrun_args)


def torchrun(argv: list[str]) -> int:
    from torch.distributed.run import main as torchrun_main

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    torchrun_main(argv)
    return 0
