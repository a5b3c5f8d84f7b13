"""Simulator: exact bubble fractions over the (p, v, m) grid, dependencies and deadlock-freedom of the lowered
schedules, deadlock reports, the text grid, and the `fxpar schedule` CLI (text, --json, errors;
--png is in test_schedule_plot.py)."""
from __future__ import annotations

import argparse
import json
from fractions import Fraction

import pytest

from fxpar.cli import schedule_command as cli_schedule
from fxpar.passes.pipeline.lower import lower
from fxpar.passes.pipeline.schedules import Action, build_schedule, parse_schedule
from fxpar.passes.pipeline.simulate import DeadlockError, check_deadlock_free, format_result, render_grid, simulate

from tests.test_schedules import GRID


def expected_bubble(kind, p, v, m):
    return Fraction(p - 1, v * m)  # gpipe / 1f1b: v = 1; interleaved and gpipe over v chunks: (p-1)/(v*m)


def assert_dependencies_respected(result, latency=Fraction(0)):
    """Independent of the simulator's logic: read the spans (integer ticks) and check every input was ready."""
    p, last, latency = result.p, result.p * result.v - 1, latency / result.tick
    end = {(a.chunk, a.kind, a.microbatch): e for tl in result.spans.values() for s, e, a in tl if not a.is_p2p}
    for rank, timeline in result.spans.items():
        previous_end = 0
        for start, stop, a in timeline:
            assert start >= previous_end, f"rank {rank} overlaps at {a}"
            previous_end = stop
            if a.is_p2p:
                continue
            c, i = a.chunk, a.microbatch
            deps = [(c - 1, "F", i)] if a.kind == "F" and c > 0 else []
            if a.kind == "B":
                deps = [(c, "F", i)] + ([(c + 1, "B", i)] if c < last else [])
            for dep in deps:
                wait = latency if dep[0] % p != rank else 0
                assert start >= end[dep] + wait, f"rank {rank}: {a} starts at {start} before {dep} is ready"


# ---------------------------------------------------------------- bubble and dependencies over the grid

def test_bubble_is_exact_over_grid():
    for kind, p, v, m in GRID:
        schedule = build_schedule(kind, p, m, v)
        for costs in ({"F": 1, "B": 2}, {"F": 1, "B": 1}):
            result = simulate(schedule, costs)
            assert result.bubble_fraction == expected_bubble(kind, p, v, m), (kind, p, v, m, costs)
            assert result.ideal == m * (costs["F"] + costs["B"])
            assert_dependencies_respected(result)


def test_bubble_formula_holds_for_other_costs():
    for kind, p, v, m in [("1f1b", 4, 1, 6), ("gpipe", 3, 2, 5), ("interleaved-1f1b", 4, 3, 8)]:
        result = simulate(build_schedule(kind, p, m, v), {"F": Fraction(3, 2), "B": 5})
        assert result.bubble_fraction == Fraction(p - 1, v * m)


def test_lowered_schedules_are_deadlock_free_and_match_compute_replay_over_grid():
    for kind, p, v, m in GRID:
        schedule = build_schedule(kind, p, m, v)
        replay = check_deadlock_free(lower(schedule, p, v))  # raises on deadlock or on a mismatched message
        assert replay.makespan == simulate(schedule).makespan, (kind, p, v, m)


@pytest.mark.parametrize("kind, p, v, m", [("1f1b", 4, 1, 8), ("interleaved-1f1b", 4, 2, 8), ("gpipe", 3, 2, 4)])
def test_p2p_latency_same_in_both_modes(kind, p, v, m):
    costs = {"F": 1, "B": 2, "p2p": Fraction(1, 3)}
    schedule = build_schedule(kind, p, m, v)
    plain, lowered = simulate(schedule, costs), simulate(lower(schedule, p, v), costs)
    assert plain.makespan == lowered.makespan
    assert plain.bubble_fraction > expected_bubble(kind, p, v, m)
    assert_dependencies_respected(plain, costs["p2p"])


def test_forward_before_backward_in_time():
    result = simulate(build_schedule("interleaved-1f1b", 4, 8, 2))
    start = {(a.chunk, a.kind, a.microbatch): s for tl in result.timelines.values() for s, e, a in tl}
    assert all(start[(c, "F", i)] < start[(c, "B", i)] for c in range(8) for i in range(8))


def test_one_rank_has_no_bubble():
    assert simulate(build_schedule("interleaved-1f1b", 1, 3, 2)).bubble_fraction == 0


# ---------------------------------------------------------------- grid and deadlocks

def test_grid_golden_1f1b():
    result = simulate(build_schedule("1f1b", 2, 3), {"F": 1, "B": 1})
    assert format_result(result) == "\n".join([
        "rank 0 | F0 F1 .  B0 F2 B1 .  B2",
        "rank 1 | .  F0 B0 F1 B1 F2 B2",
        "bubble fraction: 1/3 = 0.3333 (makespan 8, ideal 6; p=2, v=1, m=3)",
    ])


def test_grid_marks_chunks_when_interleaved_and_spans_long_actions():
    rows = render_grid(simulate(build_schedule("interleaved-1f1b", 2, 2, 2)).timelines, v=2)
    assert rows[0].startswith("rank 0 | 0F0 0F1 2F0 2F1 .   .   .   2B0 -   2B1 -   0B0")


def test_deadlock_is_reported_with_stuck_steps():
    schedule = parse_schedule({0: "0B0 0F0", 1: "1F0 1B0"})
    with pytest.raises(DeadlockError) as info:
        simulate(schedule)
    message = str(info.value)
    assert "deadlock: no rank can make progress" in message
    assert "rank 0 |   [!0B0] step 0 waits for 0F0 on rank 0" in message
    assert "rank 1 |   [!1F0] step 0 waits for 0F0 on rank 0" in message


def test_lowered_deadlock_when_a_send_comes_after_a_waiting_compute():
    schedule = parse_schedule({0: "0F0 0RECV_B0<1 0B0 0SEND_F0>1", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"})
    with pytest.raises(DeadlockError, match=r"(?s)rank 0 \| F0\s+\[!0B0\] step 2 waits for 1B0 from rank 1"):
        simulate(schedule)


def test_receives_match_by_message_not_by_order():
    """Messages carry tags: two receives posted in either order get the right tensors (as gloo matches them)."""
    lowered = lower(build_schedule("1f1b", 2, 2), 2, 1)
    r0 = lowered[0]
    i, j = r0.index(Action.parse("0RECV_B0<1")), r0.index(Action.parse("0RECV_B1<1"))
    r0[i], r0[j] = r0[j], r0[i]
    assert simulate(lowered).makespan == simulate(build_schedule("1f1b", 2, 2)).makespan


def test_a_missing_send_is_a_deadlock():
    lowered = lower(build_schedule("1f1b", 2, 2), 2, 1)
    lowered[1] = [a for a in lowered[1] if str(a) != "1SEND_B0>0"]
    with pytest.raises(DeadlockError, match=r"\[!0B0\] step \d+ waits for 1B0 from rank 1"):
        simulate(lowered)


def test_missing_recv_is_an_error():
    lowered = lower(build_schedule("1f1b", 2, 1), 2, 1)
    lowered[1] = [a for a in lowered[1] if a.kind != "RECV_F"]
    with pytest.raises(ValueError, match="no RECV precedes it"):
        simulate(lowered)


@pytest.mark.parametrize("costs, match", [({"F": 0}, "cost F=0 must be a number > 0"),
                                          ({"X": 1}, "unknown cost keys"), ({"p2p": -1}, "p2p >= 0")])
def test_bad_costs(costs, match):
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 2, 2), costs)


# ---------------------------------------------------------------- CLI

def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="fxpar")
    cli_schedule.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schedule"] + argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_grid_and_bubble(capsys):
    code, out, _ = run_cli(["--pp", "4", "--vpp", "2", "--microbatches", "8", "--schedule", "interleaved-1f1b"],
                           capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("rank 0 | 0F0 0F1")
    assert "bubble fraction: 3/16 = 0.1875" in out


def test_cli_json(capsys):
    code, out, _ = run_cli(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--json",
                            "--forward-cost", "1", "--backward-cost", "1"], capsys)
    data = json.loads(out)
    assert code == 0 and data["bubble_fraction"] == 3 / 8 and data["bubble_fraction_exact"] == "3/8"
    assert (data["pp"], data["vpp"], data["microbatches"], data["schedule"], data["makespan"]) == (4, 1, 8, "1f1b", 22)
    assert data["actions"]["3"].startswith("3F0 3B0 3F1")
    assert data["lowered_actions"]["3"].startswith("3RECV_F0<2 3F0 3B0 3SEND_B0>2")


@pytest.mark.parametrize("argv, match", [
    (["--pp", "4", "--vpp", "2", "--microbatches", "6", "--schedule", "interleaved-1f1b"],
     "fxpar schedule: error: interleaved-1f1b needs microbatches to be a multiple of pp: m=6, p=4; use m=4 or m=8"),
    (["--pp", "0", "--microbatches", "6"], "fxpar schedule: error: 1f1b needs pp (p) to be an int >= 1, got 0"),
    (["--pp", "2", "--microbatches", "2", "--backward-cost", "-1"], "fxpar schedule: error: cost B=-1"),
])
def test_cli_bad_input_returns_2(argv, match, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == "" and err.startswith(match)
