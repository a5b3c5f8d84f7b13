"""The partition pass in one process: chained chunks equal the unsplit graph; balance; refusals."""
import pytest
import torch
import torch.nn as nn
from expecttest import TestCase

from fxpar.api import build
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.frontend.layers import find_layers
from fxpar.passes.pipeline.partition import balance, partition_pass
from tests import models
from tests.golden import graph_text


def _chain(pm, partition, flat):
    """Run the chunks one after another in this process, handing each boundary to the next."""
    received = []
    for chunk in partition.chunks:
        received = list(chunk.gm(*pm._chunk_inputs(chunk, flat, received)))
    return received


@pytest.mark.parametrize("name,k", [("gpt8", 4), ("gpt5", 4), ("llama8", 3), ("gpt2", 2), ("bert", 2)])
def test_chained_chunks_equal_the_whole_graph(name, k):
    model, args, kwargs = models.build(name)
    pm = build(model, TPComm(0, 1), args, kwargs)
    flat = pm._flatten_inputs(args, kwargs)
    whole = pm.compiled.callables[0](*pm._graph_inputs(flat))
    part = partition_pass(pm.compiled.callables[0], k)
    assert [c.index for c in part.chunks] == list(range(k))
    chained = _chain(pm, part, flat)
    assert len(chained) == len(whole) and all(torch.equal(a, b) for a, b in zip(chained, whole))


def test_boundary_is_the_residual_stream_only():
    model, args, kwargs = models.build("llama8")
    pm = build(model, TPComm(0, 1), args, kwargs)
    part = partition_pass(pm.compiled.callables[0], 4)
    assert find_layers(pm.compiled.callables[0]).main.path == "model.layers" == part.block
    for chunk in part.chunks[1:]:
        assert len(chunk.boundary_in) == 1  # masks and rotary tables are recomputed, not sent
    assert [c.layers for c in part.chunks] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_balance_uneven_layers_never_drops_one():
    runs = balance([1.0] * 5, 0.0, 0.0, 4)
    assert sum(runs, []) == [0, 1, 2, 3, 4] and max(map(len, runs)) == 2 and all(runs)
    assert balance([1.0] * 4, 3.0, 0.0, 2) == [[0], [1, 2, 3]]  # the embedding weighs on chunk 0
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into p\*v = 4 chunks"):
        balance([1.0, 1.0], 0.0, 0.0, 4)


class TwoBlocks(nn.Module):
    """Two residual MLP blocks in a ModuleList: cut into 2 chunks at the residual stream."""

    def __init__(self, h: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(h, 2 * h), nn.ReLU(), nn.Linear(2 * h, h))
                                    for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_golden_two_chunks_hand_over_the_residual_stream():
    pm = build(TwoBlocks(), TPComm(0, 1), (torch.randn(2, 3, 8),))
    part = partition_pass(pm.compiled.callables[0], 2)
    text = "".join(f"chunk {c.index} layers {c.layers}: in {list(c.boundary_in)} out {list(c.boundary_out)}\n"
                   f"{graph_text(c.gm, placements=False)}" for c in part.chunks)
    TestCase().assertExpectedInline(text, """\
chunk 0 layers (0,): in [] out [BoundaryValue(name='add', shape=(2, 3, 8), dtype=torch.float32, placement=Replicate())]
linear = linear.default(x, p_layers_0_0_weight, p_layers_0_0_bias)
relu = relu.default(linear)
linear_1 = linear.default(relu, p_layers_0_2_weight, p_layers_0_2_bias)
add = add.Tensor(x, linear_1)
chunk 1 layers (1,): in [BoundaryValue(name='add', shape=(2, 3, 8), dtype=torch.float32, placement=Replicate())] out []
linear_2 = linear.default(add, p_layers_1_0_weight, p_layers_1_0_bias)
relu_1 = relu.default(linear_2)
linear_3 = linear.default(relu_1, p_layers_1_2_weight, p_layers_1_2_bias)
add_1 = add.Tensor(add, linear_3)
""")
