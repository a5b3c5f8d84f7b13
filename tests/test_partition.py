"""The partition pass in one process: chained chunks equal the unsplit graph; balance; refusals."""
import pytest
import torch

from fxpar.api import build
from fxpar.passes.collectives import TPComm
from fxpar.passes.layers import find_layers
from fxpar.passes.partition import balance, partition_pass
from tests import models


def _chain(pm, partition, flat):
    """Run the chunks one after another in this process, handing each boundary to the next."""
    received = []
    for chunk in partition.chunks:
        received = list(chunk.gm(*pm.chunk_inputs(chunk, flat, received)))
    return received


@pytest.mark.parametrize("name,k", [("gpt8", 4), ("gpt5", 4), ("llama8", 3), ("gpt2", 2), ("bert", 2)])
def test_chained_chunks_equal_the_whole_graph(name, k):
    model, args, kwargs = models.build(name)
    pm = build(model, TPComm(0, 1), args, kwargs)
    flat = pm.flatten_inputs(args, kwargs)
    whole = pm.graph_module(*pm.graph_inputs(flat))
    part = partition_pass(pm.graph_module, k)
    assert [c.index for c in part.chunks] == list(range(k))
    chained = _chain(pm, part, flat)
    assert len(chained) == len(whole) and all(torch.equal(a, b) for a, b in zip(chained, whole))


def test_boundary_is_the_residual_stream_only():
    model, args, kwargs = models.build("llama8")
    pm = build(model, TPComm(0, 1), args, kwargs)
    part = partition_pass(pm.graph_module, 4)
    assert find_layers(pm.graph_module).main.path == "model.layers" == part.block
    for chunk in part.chunks[1:]:
        assert len(chunk.boundary_in) == 1  # masks and rotary tables are recomputed, not sent
    assert [c.layers for c in part.chunks] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_balance_uneven_layers_never_drops_one():
    runs = balance([1.0] * 5, 0.0, 0.0, 4)
    assert sum(runs, []) == [0, 1, 2, 3, 4] and max(map(len, runs)) == 2 and all(runs)
    assert balance([1.0] * 4, 3.0, 0.0, 2) == [[0], [1, 2, 3]]  # the embedding weighs on chunk 0
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into p\*v = 4 chunks"):
        balance([1.0, 1.0], 0.0, 0.0, 4)
