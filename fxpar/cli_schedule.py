"""`fxpar schedule`: build a pipeline schedule, replay it, print the rank x time grid and the bubble fraction.

    fxpar schedule --pp 4 --vpp 2 --microbatches 8 --schedule interleaved-1f1b
    fxpar schedule --pp 4 --microbatches 8 --schedule 1f1b --json
    fxpar schedule --pp 4 --microbatches 8 --png timeline.png

Needs no torch: it only uses fxpar.passes.schedules / lower_schedule / proofs / simulate. The lowered program is
checked by the same proof the compiler runs before every pipelined step (passes/proofs.py). The PNG is written by a tiny
pure-Python encoder (filled rectangles, one color per microbatch, lighter for backward): no matplotlib.
"""
from __future__ import annotations

import argparse
import colorsys
import json
import struct
import sys
import zlib
from fractions import Fraction

from fxpar.cost.pipeline import SCHEDULES
from fxpar.passes.lower_schedule import lower_program
from fxpar.passes.proofs import prove
from fxpar.passes.schedules import build_schedule, format_schedule
from fxpar.passes.simulate import SimResult, format_result, simulate


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
    parser.add_argument("--png", metavar="FILE", help="also draw the timeline as a Gantt chart PNG")
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
    if args.png:
        write_gantt_png(args.png, result)
    if args.json:
        print(json.dumps(_as_json(args, result, schedule, program.actions), indent=2))
    else:
        print(format_result(result))
    return 0


def _as_json(args: argparse.Namespace, result: SimResult, schedule: dict, lowered: dict) -> dict:
    return {"schedule": args.schedule, "pp": result.p, "vpp": result.v, "microbatches": result.m,
            "forward_cost": float(args.forward_cost), "backward_cost": float(args.backward_cost),
            "bubble_fraction": float(result.bubble_fraction), "bubble_fraction_exact": str(result.bubble_fraction),
            "makespan": float(result.makespan), "ideal": float(result.ideal),
            "actions": {str(rank): line for rank, line in format_schedule(schedule).items()},
            "lowered_actions": {str(rank): line for rank, line in format_schedule(lowered).items()}}


# ---------------------------------------------------------------- Gantt chart as PNG, pure Python

def _color(microbatch: int, m: int, backward: bool) -> bytes:
    """One hue per microbatch; backward is the lighter shade of the same hue."""
    r, g, b = colorsys.hls_to_rgb(0.85 * microbatch / max(m, 1), 0.75 if backward else 0.45, 0.75)
    return bytes((int(r * 255), int(g * 255), int(b * 255)))


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, pixels: list[bytearray]) -> bytes:
    """8-bit RGB PNG from rows of width*3 bytes (filter type 0 on every row)."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(raw, 9))
            + _png_chunk(b"IEND", b""))


def write_gantt_png(path: str, result: SimResult, row_height: int = 24, max_width: int = 1600) -> None:
    """One row per rank, one filled rectangle per compute action (1 px gaps mark action boundaries)."""
    scale = max(1, min(40, max_width // max(1, int(result.makespan))))  # pixels per unit of time
    width, height = max(1, int(result.makespan * scale)), row_height * result.p
    pixels = [bytearray(b"\xff\xff\xff" * width) for _ in range(height)]
    for rank, timeline in result.timelines.items():
        for start, end, action in timeline:
            if action.is_p2p:
                continue
            x0, x1 = int(start * scale), max(int(start * scale) + 1, int(end * scale) - 1)
            color = _color(action.microbatch, result.m, action.kind == "B")
            for y in range(rank * row_height + 2, (rank + 1) * row_height - 2):
                pixels[y][x0 * 3:x1 * 3] = color * (x1 - x0)
    with open(path, "wb") as f:
        f.write(encode_png(width, height, pixels))
