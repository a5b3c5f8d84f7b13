"""The pipeline proofs (passes/pipeline/proofs.py) in one process: the programs the compiler lowers pass, and each kind
of broken program is refused with every rank's actions printed and the failing step marked."""
from __future__ import annotations

import pytest
import torch

from fxpar.passes.pipeline.lower import Program, lower_program
from fxpar.passes.pipeline.partition import BoundaryValue, Chunk
from fxpar.passes.ir.placements import Partial, Replicate, Shard
from fxpar.passes.pipeline.proofs import ProofError, format_program, prove
from fxpar.passes.pipeline.schedules import Action, build_schedule, parse_schedule
from tests.test_schedules import GRID


def _program(lines: dict[int, str], p: int, v: int, m: int) -> Program:
    return Program(p, v, m, {r: tuple(acts) for r, acts in parse_schedule(lines).items()})


def test_every_lowered_schedule_of_the_grid_is_proven():
    for kind, p, v, m in GRID:
        replay = prove(lower_program(build_schedule(kind, p, m, v), p, v, m))
        assert replay.p == p and replay.m == m, (kind, p, v, m)


def test_a_misordered_program_is_refused_with_the_grid():
    """Rank 0 runs 1F1B's order while rank 1 runs GPipe's: rank 0's B0 needs rank 1's B0, which needs F1, whose
    input rank 0 sends only after B0. Both ranks wait for each other."""
    program = _program({0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0 0F1 0SEND_F1>1 0RECV_B1<1 0B1",
                        1: "1RECV_F0<0 1RECV_F1<0 1F0 1F1 1B0 1SEND_B0>0 1B1 1SEND_B1>0"}, 2, 1, 2)
    with pytest.raises(ProofError) as info:
        prove(program)
    message = str(info.value)
    assert "deadlock: no rank can make progress" in message
    assert "[!0B0] step 3 waits for 1B0 from rank 1" in message
    assert "[!1F1] step 3 waits for 0F1 from rank 0" in message
    assert message.count("rank 0 |") == 1 and message.count("rank 1 |") == 1  # the grid, one row per rank


def test_a_send_nobody_receives_is_refused_and_marked():
    lines = {0: "0F0 0SEND_F0>1 0B0", 1: "1F0 1B0 1SEND_B0>0"}  # rank 1 posts no RECV_F, rank 0 no RECV_B
    with pytest.raises(ProofError, match=r"matching: rank 0 sends the activation of chunk 0 -> 1 for microbatch 0 "
                                         r"to rank 1, which never receives it") as info:
        prove(_program(lines, 2, 1, 1))
    assert "rank 0 | 0F0 [!0SEND_F0>1] 0B0" in str(info.value)


def test_a_message_sent_twice_is_refused():
    lines = {0: "0F0 0SEND_F0>1 0SEND_F0>1 0RECV_B0<1 0B0", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"}
    with pytest.raises(ProofError, match="matching: rank 0 sends the activation of chunk 0 -> 1 for microbatch 0 "
                                         "twice"):
        prove(_program(lines, 2, 1, 1))


def test_a_compute_order_error_is_refused():
    with pytest.raises(ProofError, match="compute: .*backward before the forward"):
        prove(_program({0: "0B0 0F0"}, 1, 1, 1))


def _chunk(index, boundary_in, boundary_out):
    return Chunk(index, None, (), tuple(boundary_in), tuple(boundary_out), (index,))


def _value(name, placement=Replicate(), shape=(2, 8, 32)):
    return BoundaryValue(name, shape, torch.float32, placement)


def test_boundaries_must_agree_and_carry_no_partial_sum():
    program = lower_program(build_schedule("1f1b", 2, 2), 2, 1, 2)
    good = [_chunk(0, [], [_value("add_3")]), _chunk(1, [_value("add_3")], [])]
    assert prove(program, good).p == 2
    wrong_shape = [_chunk(0, [], [_value("add_3")]), _chunk(1, [_value("add_3", shape=(2, 8, 16))], [])]
    with pytest.raises(ProofError, match="boundaries: chunk 0 sends .*add_3: R 2x8x32.* but chunk 1 receives "
                                         ".*add_3: R 2x8x16"):
        prove(program, wrong_shape)
    partial = [_chunk(0, [], [_value("linear_3", Partial())]), _chunk(1, [_value("linear_3", Partial())], [])]
    with pytest.raises(ProofError, match="linear_3: P .* crosses from chunk 0 to 1 as a partial sum"):
        prove(program, partial)
    sharded = [_chunk(0, [], [_value("scores", Shard(1, (4,)))]), _chunk(1, [_value("scores", Shard(1, (4,)))], [])]
    assert prove(program, sharded).p == 2  # a sharded value may cross: tp rank i sends its own block to rank i


def test_format_program_marks_the_given_steps():
    program = lower_program(build_schedule("1f1b", 2, 1), 2, 1, 1)
    text = format_program(program, [(1, Action.parse("1F0"))])
    assert text.splitlines()[1] == "rank 1 | 1RECV_F0<0 [!1F0] 1B0 1SEND_B0>0"
