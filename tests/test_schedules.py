"""Schedules as data: Action text round-trip, builder invariants over a (p, v, m) grid, lowering, memory, errors.

All in one process (STYLE.md 12): the p2p order is checked by message matching, not by running gloo.
"""
from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from fxpar.passes.pipeline.lower import lower, lower_program, p2p_streams
from fxpar.passes.pipeline.proofs import prove
from fxpar.passes.pipeline.schedules import (KINDS, Action, build_schedule, validate_actions, format_schedule,
                                             parse_schedule, peak_in_flight, schedule_shape)


def grid():
    """(kind, p, v, m) over p in 2..8, v in 1..4, m in p..4p, plus m not a multiple of p where the kind allows."""
    for p in range(2, 9):
        for m in sorted({p, 2 * p, 3 * p, 4 * p, 1, p - 1, p + 1, 2 * p + 1}):
            yield "1f1b", p, 1, m
            yield "gpipe", p, 1, m
        for v in range(2, 5):
            for m in (p, 2 * p, 3 * p, 4 * p):
                yield "interleaved-1f1b", p, v, m
            for m in (p, p + 1, 3 * p - 1):
                yield "gpipe", p, v, m


GRID = list(grid())


# ---------------------------------------------------------------- Action

@pytest.mark.parametrize("text", ["0F1", "1B0", "12F34", "0SEND_F1>1", "1RECV_F1<0", "2SEND_B3>1", "1RECV_B0<2"])
def test_action_text_round_trip(text):
    assert str(Action.parse(text)) == text


def test_action_round_trip_every_kind():
    for kind, chunk, mb in itertools.product(KINDS, (0, 3), (0, 7)):
        action = Action(chunk, kind, mb, 1 if kind not in ("F", "B") else None)
        assert Action.parse(str(action)) == action


def test_action_fields_and_frozen():
    a = Action.parse("3B2")
    assert (a.chunk, a.kind, a.microbatch, a.peer) == (3, "B", 2, None)
    with pytest.raises(AttributeError):
        a.chunk = 1


@pytest.mark.parametrize("text, match", [
    ("F1", "cannot parse"), ("0X1", "cannot parse"), ("0SEND_F1", "needs a peer"), ("0F1>1", "takes no peer"),
    ("0SEND_F1<1", "'>'"), ("1RECV_F1>0", "'<'"),
])
def test_action_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        Action.parse(text)


def test_action_validation():
    with pytest.raises(ValueError, match="kind 'X' is unknown"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match="microbatch must be an int >= 0"):
        Action(0, "F", -1)


def test_message_of_send_equals_message_of_matching_recv():
    assert Action.parse("0SEND_F1>1").message() == Action.parse("1RECV_F1<0").message() == ("F", 0, 1, 1)
    assert Action.parse("5SEND_B2>0").message() == Action.parse("4RECV_B2<1").message() == ("B", 5, 4, 2)


def test_format_parse_schedule_round_trip():
    schedule = lower(build_schedule("interleaved-1f1b", 2, 4, 2), 2, 2)
    assert parse_schedule(format_schedule(schedule)) == schedule


# ---------------------------------------------------------------- builders

def test_megatron_1f1b_order():
    s = build_schedule("1f1b", 4, 6)
    assert format_schedule(s) == {
        0: "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
        1: "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
        2: "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
        3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    }


def test_megatron_interleaved_order():
    # p=2, v=2, m=4. Warmup (p-rank-1)*2 + (v-1)*p: 4 forwards on rank 0, 2 on rank 1. The k-th forward runs local
    # chunk (k // p) % v (reversed for backward) on microbatch (k // (p*v))*p + k % p.
    assert format_schedule(build_schedule("interleaved-1f1b", 2, 4, 2)) == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    }


def test_interleaved_m_equal_p_is_all_warmup():
    # Megatron: with m == p every rank runs all m*v forwards first
    schedule = build_schedule("interleaved-1f1b", 2, 2, 2)
    assert all([a.kind for a in acts] == ["F"] * 4 + ["B"] * 4 for acts in schedule.values())


def test_gpipe_order_with_chunks():
    assert format_schedule(build_schedule("gpipe", 2, 2, 2))[1] == "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"


def test_interleaved_v1_is_1f1b():
    assert build_schedule("interleaved-1f1b", 4, 6, 1) == build_schedule("1f1b", 4, 6)


def test_builders_are_pure():
    assert build_schedule("1f1b", 3, 5) == build_schedule("1f1b", 3, 5)


def test_every_chunk_microbatch_once_forward_first_over_grid():
    for kind, p, v, m in GRID:
        schedule = build_schedule(kind, p, m, v)
        validate_actions(schedule, p, m, v)  # raises on a missing/duplicate F or B, wrong rank, B before F
        assert schedule_shape(schedule) == (p, v, m)
        assert all(len(actions) == 2 * m * v for actions in schedule.values())


def test_validate_actions_rejects_bad_schedules():
    s = build_schedule("1f1b", 2, 2)
    swapped = {0: s[0], 1: [s[1][1], s[1][0]] + s[1][2:]}
    with pytest.raises(ValueError, match="backward before the forward"):
        validate_actions(swapped, 2, 2)
    with pytest.raises(ValueError, match="misses 1 compute actions"):
        validate_actions({0: s[0], 1: s[1][:-1]}, 2, 2)
    with pytest.raises(ValueError, match="belongs to rank 1, not rank 0"):
        validate_actions({0: s[0] + [Action(1, "F", 0)], 1: s[1]}, 2, 2)


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_peak_in_flight_1f1b_and_gpipe(p, m):
    assert peak_in_flight(build_schedule("1f1b", p, m), 1) == {r: min(p - r, m) for r in range(p)}
    assert peak_in_flight(build_schedule("gpipe", p, m), 1) == {r: m for r in range(p)}
    if m >= p:
        assert peak_in_flight(build_schedule("gpipe", p, m, 3), 3) == {r: m for r in range(p)}


def test_peak_in_flight_interleaved_is_warmup_plus_one_chunk():
    p, v, m = 4, 2, 8
    peaks = peak_in_flight(build_schedule("interleaved-1f1b", p, m, v), v)
    assert peaks == {r: Fraction(min((p - r - 1) * 2 + (v - 1) * p + 1, m * v), v) for r in range(p)}


# ---------------------------------------------------------------- lowering

def test_lowering_golden_1f1b():
    """Each RECV is posted right after the rank's previous SEND (or at the start); its compute waits for it."""
    lowered = lower(build_schedule("1f1b", 2, 2), 2, 1)
    assert format_schedule(lowered) == {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0RECV_B1<1 0B0 0B1",
        1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0",
    }


def test_message_tags_are_unique_and_shared_by_send_and_receive():
    program = lower_program(build_schedule("interleaved-1f1b", 2, 4, 2), 2, 2, 4)
    sends = {(r, a.peer, program.tag(a)) for r, acts in program.actions.items() for a in acts if a.is_send}
    recvs = {(a.peer, r, program.tag(a)) for r, acts in program.actions.items() for a in acts if a.is_p2p
             and not a.is_send}
    n = sum(1 for acts in program.actions.values() for a in acts if a.is_send)
    assert sends == recvs and len(sends) == n


def test_lowering_adds_nothing_on_one_rank():
    schedule = build_schedule("interleaved-1f1b", 1, 3, 2)
    assert lower(schedule, 1, 2) == schedule


def test_lowering_keeps_compute_order_and_pairs_every_message_over_grid():
    for kind, p, v, m in GRID:
        schedule = build_schedule(kind, p, m, v)
        lowered = lower(schedule, p, v)
        assert {r: [a for a in acts if not a.is_p2p] for r, acts in lowered.items()} == schedule
        prove(lower_program(schedule, p, v, m))  # every message sent once, received once, no deadlock
        n_messages = sum(len(sends) for sends, _ in p2p_streams(lowered).values())
        assert n_messages == 2 * m * (p * v - 1)  # every chunk boundary, both directions, every microbatch


def test_lowering_rejects_lowered_input():
    lowered = lower(build_schedule("1f1b", 2, 2), 2, 1)
    with pytest.raises(ValueError, match="already lowered"):
        lower(lowered, 2, 1)


# ---------------------------------------------------------------- input errors

@pytest.mark.parametrize("args, match", [
    (("interleaved-1f1b", 4, 6, 2), r"multiple of pp: m=6, p=4; use m=4 or m=8"),
    (("interleaved-1f1b", 4, 3, 2), r"m=3, p=4; use m=4$"),
    (("1f1b", 4, 8, 2), r"got v=2; use schedule 'interleaved-1f1b'"),
    (("gpipe", 4, 3, 2), r"microbatches >= pp: m=3, p=4"),
    (("zigzag", 4, 8, 1), r"unknown pipeline schedule 'zigzag'; use one of gpipe, 1f1b, interleaved-1f1b"),
    (("1f1b", 0, 8, 1), r"pp \(p\) to be an int >= 1, got 0"),
    (("1f1b", 2, 0, 1), r"microbatches \(m\) to be an int >= 1, got 0"),
    (("gpipe", 2, 2, 0), r"vpp \(v\) to be an int >= 1, got 0"),
])
def test_bad_sizes_raise_with_numbers_and_fix(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)
