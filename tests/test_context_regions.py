"""passes/frontend/context_regions.py: `with torch.autocast(...)` inside a forward (torch.export's
wrap_with_autocast) inlined between the context's enter and exit calls, so the attention around it shards; exact
at t=2, nested regions too, and the traced program itself is left as it was."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from fxpar.api import build
from fxpar.compiler import Target, compile_model
from fxpar.passes.frontend.context_regions import WRAP, inline_context_pass
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.trace import trace
from tests.golden import graph_text
from tests.models import Stack, gaps_and_share
from tests.threaded import on_tp_ranks

D, HEADS, SEQ = 32, 4, 8
HD = D // HEADS


class Rotary(nn.Module):
    """Attention whose rotary arithmetic runs in fp32 with autocast off (Llama-style code), and an MLP whose norm
    sits in a region nested inside another."""

    def __init__(self):
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        angles = torch.outer(torch.arange(SEQ).float(), 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD))
        self.register_buffer("cos", angles.cos().repeat(1, 2))
        self.register_buffer("sin", angles.sin().repeat(1, 2))

    def _rotate(self, x):
        with torch.autocast("cpu", enabled=False):
            x = x.float()
            half = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], dim=-1)
            return x * self.cos + half * self.sin

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (w(h).view(b, s, HEADS, HD).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        with torch.autocast("cpu", enabled=False):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
                h = self.norm2(x.float())
        return x + self.down(F.gelu(self.up(h)))


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(0))


def test_golden_a_region_inlined_between_enter_and_exit():
    class Region(nn.Module):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                x = x.float().sin()
            return x * 2

    gm = inline_context_pass(trace(Region(), (_x(),), {}).gm)
    TestCase().assertExpectedInline(graph_text(gm, placements=False), """\
_enter_autocast = _enter_autocast(cpu, torch.bfloat16, False, False)
_assert_tensor_metadata_default = _assert_tensor_metadata.default(x)
to = to.dtype(x, torch.float32)
sin_1 = sin.default(to)
_exit_autocast = _exit_autocast(_enter_autocast)
mul = mul.Tensor(sin_1, 2)
""")


def test_the_attention_around_a_region_shards_at_two_and_two():
    torch.manual_seed(0)
    plan = build(Stack(Rotary), TPComm(rank=0, size=2), (_x(),)).plan
    assert not plan.replicated, plan.region_table()
    assert {w.key: w.placement for w in plan.weights}["layers.0.q.weight"] == "S(0)"


def test_the_traced_program_keeps_its_regions():
    torch.manual_seed(0)
    c = compile_model(Stack(Rotary), (_x(),), {}, Target(TPComm(0, 2)))
    assert any(n.target is WRAP for n in c.traced.gm.graph.nodes)
    assert not any(n.target is WRAP for n in c.gm.graph.nodes)


def test_exact_at_t2():
    torch.manual_seed(0)
    model, x = Stack(Rotary), _x()
    for fwd, params, share in on_tp_ranks(model, (x,), gaps_and_share((x,))):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.55, share
