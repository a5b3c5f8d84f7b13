"""Bad input gets a clear fxpar error: what, where, the numbers, and the fix. Never a silent wrong result."""
import pytest
import torch
import torch.nn as nn

import fxpar
from fxpar.api import build
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.trace import TraceError
from tests.harness import module_pool
from tests import models

pool2 = module_pool(2)


def test_heads_not_divisible_by_t():
    model, args, kwargs = models.build("gpt")  # 4 heads
    with pytest.raises(ValueError) as e:
        build(model, TPComm(rank=0, size=3), args, kwargs)
    msg = str(e.value)
    assert "t=3" in msg and "h.0.attn" in msg and "Fix: choose a tensor-parallel degree" in msg


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # python control flow on a tensor value
            return x * 2
        return x


def test_untraceable_model_shows_export_reason():
    with pytest.raises(TraceError) as e:
        build(DataDependent(), TPComm(0, 2), (torch.randn(3),))
    assert "export said" in str(e.value) and "data-dependent" in str(e.value).lower()


class DataDependentSize(nn.Module):
    """Traceable (export gives the size an unbacked symbol), but not a program of static shapes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        keep = (x[0, :, 0] > 0).nonzero().squeeze(-1)  # how many positions: known only from the data
        return self.proj(x.index_select(1, keep)).sum(1)


def test_a_data_dependent_size_is_refused_naming_the_node():
    with pytest.raises(TraceError) as e:
        build(DataDependentSize(), TPComm(0, 2), (torch.randn(2, 5, 8),))
    msg = str(e.value)
    assert "node nonzero" in msg and "depends on tensor data" in msg and "Fix:" in msg, msg


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x).relu()


def test_nothing_to_shard_warns_and_runs_replicated():
    model, x = Norms(), torch.randn(2, 8)
    with pytest.warns(UserWarning, match="found nothing to shard in Norms at t=2"):
        pm = build(model, TPComm(0, 2), (x,))
    assert torch.equal(pm(x), model(x))


def test_input_shape_differs_from_trace():
    model, args, kwargs = models.build("gpt")
    pm = build(model, TPComm(0, 1), args, kwargs)
    with pytest.raises(ValueError, match=r"input 0 has shape \(4, 8\), but the model was traced with \(2, 8\)"):
        pm(torch.zeros(4, 8, dtype=torch.long))


def test_bad_api_arguments():
    with pytest.raises(TypeError, match="example_args must be a tuple"):
        fxpar.parallelize(Norms(), None, example_args=torch.randn(2, 8))
    with pytest.raises(ValueError, match="Config.schedule must be one of"):
        fxpar.Config(schedule="zigzag")
    with pytest.raises(ValueError, match="Config.scatter_gather must be True, False or 'auto'"):
        fxpar.Config(scatter_gather="yes")


def _mesh_bigger_than_world():
    try:
        fxpar.init_mesh(tp=4)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mesh_size_differs_from_world(pool2):
    for msg in pool2.run(_mesh_bigger_than_world):
        assert "pp*dp*tp = 1*1*4 = 4, but the world size is 2" in msg


def test_verify_names_the_first_diverging_node():
    model, args, kwargs = models.build("gpt")
    pm = build(model, TPComm(0, 1), args, kwargs)
    assert fxpar.verify(model, pm, args, kwargs) <= 1e-5
    with torch.no_grad():
        pm.get_parameter("h.1.mlp.c_fc.weight")[0, 0] += 0.5  # a wrong weight in layer 1
    with pytest.raises(fxpar.VerifyError, match=r"node linear_6 \(aten.linear.default, module h.1.mlp.c_fc\)"):
        fxpar.verify(model, pm, args, kwargs)
