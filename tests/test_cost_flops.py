"""Eq. 2 (parameters), Eq. 3 (FLOPs per iteration) and Eq. 4 (training days) of PTD-P."""
import json
import re
from pathlib import Path

import pytest

from fxpar.cost.flops import (flops_eq3_closed_form, flops_per_iteration, layer_forward_flops, parameters,
                              training_days, training_seconds)
from fxpar.cost.shape import ModelShape

REFERENCE = Path(__file__).resolve().parent / "data" / "megatron.json"  # the papers' numbers (tests/data/README.md)


def reference() -> dict:
    return json.loads(REFERENCE.read_text())


GPT3 = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)


def test_parameters_match_eq2_closed_form():
    l, h, V, s = GPT3.layers, GPT3.hidden, GPT3.vocab, GPT3.seq
    eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert parameters(GPT3) == pytest.approx(eq2, rel=1e-12)
    assert parameters(GPT3) == pytest.approx(174.6e9, rel=1e-3)


def test_parameters_match_table1_sizes():
    table = reference()["ptdp_table1"]
    for row in table["rows"]:
        r = dict(zip(table["columns"], row))
        shape = ModelShape(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=2048, vocab=51200)
        assert abs(parameters(shape) / 1e9 - r["params_billion"]) <= 0.05, r  # the table rounds to 0.1B


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_flops_per_iteration_equals_eq3_closed_form(recompute):
    assert flops_per_iteration(GPT3, recompute) == pytest.approx(flops_eq3_closed_form(GPT3, recompute), rel=1e-12)


def test_recompute_adds_one_forward_pass_of_the_layers():
    full, none = flops_per_iteration(GPT3, "full"), flops_per_iteration(GPT3, "none")
    assert full - none == pytest.approx(GPT3.layers * layer_forward_flops(GPT3, GPT3.batch), rel=1e-12)
    assert none < flops_per_iteration(GPT3, "selective") < full


def test_ffn_width_changes_the_layer_flops():
    wide = ModelShape(layers=2, hidden=64, heads=4, seq=16, vocab=10, ffn_hidden=512)
    narrow = ModelShape(layers=2, hidden=64, heads=4, seq=16, vocab=10)
    assert layer_forward_flops(wide, 1) - layer_forward_flops(narrow, 1) == 2 * 16 * 2 * 64 * (512 - 256)


def _params_of(example: dict) -> float:
    if "params" in example:
        return example["params"]
    match = re.search(r"(\d+(?:\.\d+)?)\s*B\b", example["model"])
    assert match, f"cannot read a parameter count from {example['model']!r}"
    return float(match.group(1)) * 1e9


def test_eq4_training_days_within_one_day():
    examples = reference()["training_time_examples"]
    assert len(examples) >= 2
    for ex in examples:
        days = training_days(ex["tokens"], _params_of(ex), ex["gpus"], ex["tflops_per_gpu"] * 1e12)
        assert abs(days - ex["days"]) <= 1.0, (ex, days)


def test_eq4_rejects_nonsense():
    with pytest.raises(ValueError, match="positive"):
        training_seconds(0, 1e9, 8, 1e12)


def test_shape_validation_names_the_field_and_nearby_heads():
    with pytest.raises(ValueError, match="layers"):
        ModelShape(layers=0, hidden=64, heads=4, seq=8, vocab=8)
    with pytest.raises(ValueError, match=r"hidden 100 is not divisible by heads 8; nearby valid head counts: 5, 10"):
        ModelShape(layers=1, hidden=100, heads=8, seq=8, vocab=8)
