"""The `fxpar` command line: show | check | schedule | plan | run | calibrate.

Each subcommand lives in its own module, which exposes `add_parser(subparsers)` and registers its handler with
`parser.set_defaults(func=...)`. This file only wires them together.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that implements it (imported lazily, so `fxpar schedule` never imports torch.export)
SUBCOMMANDS = {
    "show": "fxpar.cli.show_command",
    "schedule": "fxpar.cli.schedule_command",
    "plan": "fxpar.cli.plan_command",
    "calibrate": "fxpar.cli.plan_command",
    "run": "fxpar.cli.run_command",
    "check": "fxpar.cli.check_command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    seen = set()
    for module_name in SUBCOMMANDS.values():
        if module_name in seen:
            continue
        seen.add(module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # subcommand not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"] and argv[1:2] not in (["-h"], ["--help"]):
        from fxpar.cli.run_command import torchrun  # everything after `run` belongs to torchrun, options first

        return torchrun(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
