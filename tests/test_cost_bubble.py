"""Bubble fractions, microbatches in flight, and the split of layers into stages."""
import pytest

from fxpar.cost.bubble import bubble_fraction, check_schedule, chunks_in_flight, split_layers


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 64), (16, 144)])
def test_bubble_fractions(p, m):
    assert bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / m)
    assert bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / m)
    for v in (2, 3, 4):
        assert bubble_fraction("interleaved-1f1b", p, m, v) == pytest.approx((p - 1) / (v * m))


def test_schedule_rules_name_the_constraint_and_nearby_values():
    with pytest.raises(ValueError, match=r"multiple of pp: m=10, p=4; use m=8 or m=12"):
        check_schedule("interleaved-1f1b", 4, 10, 2)
    with pytest.raises(ValueError, match="one chunk per device"):
        check_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zero-bubble'"):
        check_schedule("zero-bubble", 4, 8, 1)


def test_the_runtime_schedules_are_valid_here_too():
    """The planner accepts what parallelize runs: gpipe over v chunks, interleaved with one chunk."""
    check_schedule("gpipe", 4, 8, 2)
    check_schedule("interleaved-1f1b", 4, 6, 1)
    assert bubble_fraction("gpipe", 4, 8, 2) == pytest.approx(3 / 16)
    assert chunks_in_flight("gpipe", 4, 8, 2, 0) == 16  # every chunk of every microbatch
    assert chunks_in_flight("interleaved-1f1b", 4, 8, 1, 0) == chunks_in_flight("1f1b", 4, 8, 1, 0) == 4


def test_in_flight_matches_korthikanti_first_stage_factor():
    p, v, m = 8, 3, 64
    # Korthikanti et al.: the first stage holds p v (1 + (p-1)/(p v)) chunk-microbatches
    assert chunks_in_flight("interleaved-1f1b", p, m, v, 0) == p * v * (1 + (p - 1) / (p * v))
    assert chunks_in_flight("1f1b", p, m, 1, 0) == p
    assert chunks_in_flight("1f1b", p, m, 1, p - 1) == 1
    assert chunks_in_flight("gpipe", p, m, 1, 0) == m
    assert chunks_in_flight("1f1b", 8, 3, 1, 0) == 3  # never more than m


def test_split_layers_even_when_head_is_light():
    assert split_layers(96, 16, 1, head_layers=0.2) == (6,) * 16
    assert split_layers(24, 1) == (24,)


def test_split_layers_moves_layers_off_the_heavy_last_stage():
    # even (3, 3, 2, 2) would make the last stage 2 + 2 = 4 layers' worth; (3, 3, 3, 1) caps every stage at 3
    assert split_layers(10, 4, 1, head_layers=2.0) == (3, 3, 3, 1)
    assert split_layers(7, 3, 2) == (3, 2, 2)  # every stage keeps one layer per chunk (v = 2)


def test_split_layers_needs_a_layer_per_chunk():
    with pytest.raises(ValueError, match=r"layers 24 < pp\*vpp = 8\*4 = 32"):
        split_layers(24, 8, 4)
