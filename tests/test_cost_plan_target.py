"""Reading (l, h, a, s, V, f) from a model traced on the meta device."""
from pathlib import Path

import pytest
import torch

from fxpar.cli.model_shape import load_factory, shape_from_graph, shape_from_target, trace_on_meta

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3_175b.py"


def test_tiny_gpt_shape():
    shape = shape_from_target(f"{EXAMPLE}:tiny", batch=8)
    assert (shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, shape.batch, shape.ffn_hidden) == \
        (4, 64, 4, 32, 128, 8, 256)


def test_trace_allocates_no_weights():
    program = trace_on_meta(load_factory(f"{EXAMPLE}:tiny"))
    assert all(p.device.type == "meta" for p in program.state_dict.values())
    assert shape_from_graph(program.graph_module).layers == 4


def test_hf_gpt2_shape(tmp_path):
    pytest.importorskip("transformers")
    factory = tmp_path / "hf_gpt2.py"
    factory.write_text(
        "import torch\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "def gpt2():\n"
        "    cfg = GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=32, vocab_size=100, use_cache=False,\n"
        "                     bos_token_id=0, eos_token_id=0)\n"
        "    return GPT2LMHeadModel(cfg), (torch.zeros(1, 16, dtype=torch.long),)\n")
    shape = shape_from_target(f"{factory}:gpt2")
    assert (shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, shape.ffn_hidden) == \
        (3, 64, 4, 16, 100, 256)


@pytest.mark.parametrize("target,message", [
    ("no_colon", "must be 'path/file.py:factory'"),
    ("missing_file.py:f", "does not exist"),
    (f"{EXAMPLE}:nope", "has no callable 'nope'"),
])
def test_bad_targets(target, message):
    with pytest.raises(ValueError, match=message):
        load_factory(target)


def test_a_graph_without_layers_says_so():
    class Flat(torch.nn.Module):
        def forward(self, x):
            return x + 1

    with pytest.raises(ValueError, match="no repeated layers"):
        shape_from_graph(torch.export.export(Flat(), (torch.ones(2),), strict=False))
