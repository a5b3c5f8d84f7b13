"""`fxpar schedule`: build a pipeline schedule, replay it, print the rank x time grid and the bubble fraction.

    fxpar schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved-1f1b
    fxpar schedule --pp 4 --microbatches 8 --schedule 1f1b --json
    fxpar schedule --pp 4 --microbatches 8 --png timeline.png

Needs no torch: it only uses fxpar.passes.pipeline.schedules / lower / proofs / simulate. The lowered program
is checked by the same proof the compiler runs before every pipelined step (passes/pipeline/proofs.py). --png draws the
timeline with matplotlib (fxpar/cli/plot.py), an optional extra: pip install 'fxpar[plot]'.
"""
from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from fxpar.cost.bubble import SCHEDULES
from fxpar.passes.pipeline.lower import lower_program
from fxpar.passes.pipeline.proofs import prove
from fxpar.passes.pipeline.schedules import build_schedule, format_schedule
from fxpar.passes.pipeline.simulate import SimResult, format_result, simulate


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("schedule", help="show a pipeline schedule's grid and bubble fraction",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank v (interleaved-1f1b, gpipe)")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per step m")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="pipeline schedule (default 1f1b)")
    parser.add_argument("--forward-cost", type=Fraction, default=Fraction(1), help="stage forward time (default 1)")
    parser.add_argument("--backward-cost", type=Fraction, default=Fraction(2), help="stage backward time (default 2)")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the grid")
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline as a Gantt chart PNG (needs matplotlib)")
    parser.set_defaults(func=handle_schedule)


def handle_schedule(args: argparse.Namespace) -> int:
    """Build, lower, check and replay the schedule; print it. Bad sizes print one error line and return 2."""
    try:
        p, v, m = args.pp, args.vpp, args.microbatches
        schedule = build_schedule(args.schedule, p, m, v)
        program = lower_program(schedule, p, v, m)
        prove(program)
        result = simulate(schedule, {"F": args.forward_cost, "B": args.backward_cost})
    except ValueError as e:
        print(f"fxpar schedule: error: {e}", file=sys.stderr)
        return 2
    if args.png and not _save_png(args.png, result, args.schedule):
        return 2
    if args.json:
        print(json.dumps(_as_json(args, result, schedule, program.actions), indent=2))
    else:
        print(format_result(result))
    return 0


def _save_png(path: str, result: SimResult, name: str) -> bool:
    """Draw the timeline to `path`; without matplotlib print one error line and return False."""
    from fxpar.cli.plot import INSTALL_HINT, MatplotlibMissing, save_schedule_png

    try:
        save_schedule_png(path, result, title=name)
    except MatplotlibMissing:
        print(f"fxpar schedule: error: --png needs matplotlib: {INSTALL_HINT}", file=sys.stderr)
        return False
    return True


def _as_json(args: argparse.Namespace, result: SimResult, schedule: dict, lowered: dict) -> dict:
    return {"schedule": args.schedule, "pp": result.p, "vpp": result.v, "microbatches": result.m,
            "forward_cost": float(args.forward_cost), "backward_cost": float(args.backward_cost),
            "bubble_fraction": float(result.bubble_fraction), "bubble_fraction_exact": str(result.bubble_fraction),
            "makespan": float(result.makespan), "ideal": float(result.ideal),
            "actions": {str(rank): line for rank, line in format_schedule(schedule).items()},
            "lowered_actions": {str(rank): line for rank, line in format_schedule(lowered).items()}}
