"""Memory per GPU: Korthikanti et al. 2022 activations, model states, the most loaded stage."""
import pytest

from fxpar.cost.cluster import GIB, builtin_clusters
from fxpar.cost.flops import parameters
from fxpar.cost.memory import (activation_bytes_per_layer, default_precision, memory_per_gpu, stage_memory,
                               stage_parameters, state_bytes, state_bytes_per_param)
from fxpar.cost.shape import ModelShape

SELENE = builtin_clusters()["selene"]
GPT3 = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)


def test_activations_without_parallelism_are_34_plus_5as_over_h():
    s, b, h, a = GPT3.seq, 1, GPT3.hidden, GPT3.heads
    assert activation_bytes_per_layer(GPT3, b, 1, "none") == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_activations_by_recompute_mode_with_tensor_parallelism():
    s, b, h, a, t = GPT3.seq, 2, GPT3.hidden, GPT3.heads, 8
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert activation_bytes_per_layer(GPT3, b, t, "none") == pytest.approx(expected)
    assert activation_bytes_per_layer(GPT3, b, t, "selective") == pytest.approx(s * b * h * (10 + 24 / t))
    assert activation_bytes_per_layer(GPT3, b, t, "full") == pytest.approx(2 * s * b * h)
    assert activation_bytes_per_layer(GPT3, b, t, "full", e=4) == pytest.approx(4 * s * b * h)


def test_state_bytes():
    """Bytes per parameter by precision and distributed optimizer (the table in cost/memory.py's docstring)."""
    assert default_precision(2) == "paper" and default_precision(4) == "fp32"
    assert [state_bytes_per_param(p) for p in ("paper", "fp32", "bf16", "fp16")] == [20, 16, 18, 18]
    for d in (1, 2, 8):
        assert state_bytes_per_param("fp32", 1, d) == pytest.approx(8 + 16 / d)
        assert state_bytes_per_param("bf16", 1, d) == pytest.approx(6 + 16 / d)
        assert state_bytes_per_param("paper", 1, d) == pytest.approx(4 + 16 / d)
    assert state_bytes("bf16") == {"weights": 2, "gradients": 4, "main": 4, "optimizer": 8}
    with pytest.raises(ValueError, match="precision must be one of"):
        state_bytes("int8")


def test_vocab_parallel_loss_keeps_the_logits_sharded():
    """Gathered logits (a loss that needs the whole vocabulary) add (e + 4) b s V on the last stage."""
    stages, kw = (48, 48), dict(t=8, b=1, m=8, v=1, schedule="1f1b", recompute="full", cluster=SELENE)
    sharded = stage_memory(GPT3, stages, 1, **kw).logits
    gathered = stage_memory(GPT3, stages, 1, vocab_parallel_loss=False, **kw).logits
    assert sharded == pytest.approx(6 * GPT3.seq * GPT3.vocab / 8)
    assert gathered - sharded == pytest.approx(6 * GPT3.seq * GPT3.vocab)


def test_stage_parameters_add_up_to_the_model():
    stages = (24, 24, 24, 24)
    total = sum(stage_parameters(GPT3, stages, i, 1) for i in range(4))
    # the last stage keeps a copy of the tied word embedding
    assert total == pytest.approx(parameters(GPT3) + GPT3.vocab * GPT3.hidden)


def test_first_stage_holds_most_activations_last_the_logits():
    stages = (12,) * 8
    kw = dict(t=8, b=1, m=96, v=1, schedule="1f1b", recompute="full", cluster=SELENE)
    first, last = stage_memory(GPT3, stages, 0, **kw), stage_memory(GPT3, stages, 7, **kw)
    assert first.activations > last.activations and last.logits > 0 == first.logits
    # 1f1b: the first stage holds p microbatches of its l/p layers = l layers' worth
    per_layer = activation_bytes_per_layer(GPT3, 1, 8, "full")
    working_set = activation_bytes_per_layer(GPT3, 1, 8, "none")
    assert first.activations == pytest.approx(GPT3.layers * per_layer + working_set)
    assert memory_per_gpu(GPT3, stages, **kw).total == max(first.total, last.total)


def test_gpt3_at_t8_p8_fits_an_80gb_gpu_and_not_at_t8_p1():
    kw = dict(t=8, b=1, m=96, v=1, schedule="1f1b", recompute="full", cluster=SELENE)
    assert memory_per_gpu(GPT3, (12,) * 8, **kw).total < 80 * GIB
    assert memory_per_gpu(GPT3, (96,), **kw).total > 80 * GIB


def test_activations_with_sequence_parallelism():
    """Korthikanti et al. 2022 Table 2's sequence-parallel rows: everything / t."""
    s, b, h, a, t = GPT3.seq, 2, GPT3.hidden, GPT3.heads, 8
    sp = dict(sequence_parallel=True)
    assert activation_bytes_per_layer(GPT3, b, t, "none", **sp) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert activation_bytes_per_layer(GPT3, b, t, "selective", **sp) == pytest.approx(34 * s * b * h / t)
    assert activation_bytes_per_layer(GPT3, b, t, "full", **sp) == pytest.approx(2 * s * b * h / t)
    assert activation_bytes_per_layer(GPT3, b, 1, "none", **sp) == activation_bytes_per_layer(GPT3, b, 1, "none")
