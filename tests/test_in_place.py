"""passes/tensor_parallel/in_place.py: f and g all-reduce in place only where the graph proves nothing else reads the
tensor. Golden decisions on simulated ranks; the numerics of every model in the suite run through it
(tests/test_tp_exact.py, test_pipeline_exact.py, ...)."""
import torch
import torch.nn as nn

from fxpar.api import build
from fxpar.passes.ir.meta import comm_kind
from fxpar.passes.tensor_parallel.collectives import TPComm
from expecttest import TestCase

from tests import models
from tests.golden import graph_text

H, HEADS = 16, 4


class PerHeadScale(nn.Module):
    """An MLP whose intermediate is scaled per head-dim by a replicated weight: that weight's f feeds a mul."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.scale = nn.Parameter(torch.ones(4 * H // HEADS))

    def forward(self, x):
        b, s, _ = x.shape
        h = (self.up(x).view(b, s, HEADS, -1) * self.scale).view(b, s, -1)
        return x + self.down(torch.relu(h))


def _decisions(model, args, kwargs=None):
    """(kind, what it reads, in place) of every f and g of the executable's graph."""
    pm = build(model, TPComm(rank=0, size=2), args, kwargs or {})
    gm = pm.compiled.callables[0]
    return [(comm_kind(n), n.args[0].name, gm.get_submodule(n.target).in_place) for n in gm.graph.nodes
            if n.op == "call_module" and comm_kind(n) in ("f", "g")], pm


def test_gpt_layers_all_reduce_in_place():
    model, args, kwargs = models.build("gpt")
    got, pm = _decisions(model, args, kwargs)
    layers = [d for d in got if d[1] != "alias"]  # the LM head's f reads the final norm through an alias
    assert layers and all(in_place for _, _, in_place in layers), got
    assert sum(kind == "g" for kind, _, _ in got) == 4  # attention and MLP of 2 layers


def test_a_weight_read_by_a_mul_keeps_its_copy():
    got, _ = _decisions(PerHeadScale(), (torch.randn(2, 3, H),))
    by_input = {src: (kind, in_place) for kind, src, in_place in got}
    assert by_input["p_scale"] == ("f", False), got  # its reader is a mul, not a GEMM
    assert by_input["x"] == ("f", True) and ("g", True) in by_input.values(), got


def test_the_graph_kept_for_verify_still_clones():
    model, args, kwargs = models.build("gpt")
    pm = build(model, TPComm(rank=0, size=2), args, kwargs)
    tp = pm.compiled.tp_graph
    assert not any(tp.get_submodule(n.target).in_place for n in tp.graph.nodes if n.op == "call_module")


def test_golden_an_mlp_reduces_in_place_and_a_weights_f_keeps_its_copy():
    gm = build(PerHeadScale(), TPComm(rank=0, size=2), (torch.randn(2, 3, H),)).compiled.callables[0]
    TestCase().assertExpectedInline(graph_text(gm), """\
tp_f_0 = tp_f_0(x)  # R 2x3x16  [f in place]
linear = linear.default(tp_f_0, p_up_weight, p_up_bias)  # S(2) 2x3x32
view = view.default(linear, [2, 3, 2, -1])  # S(2) 2x3x2x16
tp_f_1 = tp_f_1(p_scale)  # R 16  [f]
mul = mul.Tensor(view, tp_f_1)  # S(2) 2x3x2x16
view_1 = view.default(mul, [2, 3, -1])  # S(2) 2x3x32
relu = relu.default(view_1)  # S(2) 2x3x32
linear_1 = linear.default(relu, p_down_weight)  # P 2x3x16
tp_g_0 = tp_g_0(linear_1)  # R 2x3x16  [g in place]
add_tensor = add.Tensor(tp_g_0, p_down_bias)  # R 2x3x16
add = add.Tensor(x, add_tensor)  # R 2x3x16
""")
