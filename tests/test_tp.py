"""passes/tensor_parallel/rewrite.py (the tensor-parallel rewrite) and passes/tensor_parallel/local_shapes.py, as golden
graphs: a simulated rank 0 of t=2, every node with its placement and this rank's shape. The numerics of the rewrite are
tests/test_tp_exact.py's and the fuzzer's; the edge cases (refusals) are tests/test_analysis.py's and
tests/test_errors.py's."""
from __future__ import annotations

import torch
import torch.nn as nn
from expecttest import TestCase

from fxpar.api import build
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.golden import graph_text

H = 8


def _golden(model, *args) -> str:
    """Rank 0's graph at t=2 right after the tensor-parallel stages (the record's tp_graph; tests/golden.py)."""
    return graph_text(build(model, TPComm(rank=0, size=2), args).compiled.tp_graph)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Attention(nn.Module):
    """Fused Q|K|V, split and viewed into heads, SDPA, the output projection."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(H, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, H))


def test_an_mlp_is_column_then_row_parallel_with_f_and_g():
    TestCase().assertExpectedInline(_golden(MLP(), torch.randn(2, 3, H)), """\
tp_f_0 = tp_f_0(x)  # R 2x3x8  [f]
linear = linear.default(tp_f_0, p_up_weight, p_up_bias)  # S(2) 2x3x16
relu = relu.default(linear)  # S(2) 2x3x16
linear_1 = linear.default(relu, p_down_weight)  # P 2x3x8
tp_g_0 = tp_g_0(linear_1)  # R 2x3x8  [g]
add_tensor = add.Tensor(tp_g_0, p_down_bias)  # R 2x3x8
add = add.Tensor(x, add_tensor)  # R 2x3x8
""")


def test_fused_qkv_is_head_interleaved():
    TestCase().assertExpectedInline(_golden(Attention(), torch.randn(2, 3, H)), """\
tp_f_0 = tp_f_0(x)  # R 2x3x8  [f]
linear = linear.default(tp_f_0, p_qkv_weight, p_qkv_bias)  # S(2, 3x[8]x1) 2x3x12
split = split_with_sizes.default(linear, [4, 4, 4], 2)  # (S(2), S(2), S(2))
getitem = getitem(split, 0)  # S(2) 2x3x4
getitem_1 = getitem(split, 1)  # S(2) 2x3x4
getitem_2 = getitem(split, 2)  # S(2) 2x3x4
view = view.default(getitem, [2, 3, 1, -1])  # S(2) 2x3x1x4
transpose = transpose.int(view, 1, 2)  # S(1) 2x1x3x4
view_1 = view.default(getitem_1, [2, 3, 1, -1])  # S(2) 2x3x1x4
transpose_1 = transpose.int(view_1, 1, 2)  # S(1) 2x1x3x4
view_2 = view.default(getitem_2, [2, 3, 1, -1])  # S(2) 2x3x1x4
transpose_2 = transpose.int(view_2, 1, 2)  # S(1) 2x1x3x4
scaled_dot_product_attention = scaled_dot_product_attention.default(transpose, transpose_1, transpose_2, None, 0.0, True)  # S(1) 2x1x3x4
transpose_3 = transpose.int(scaled_dot_product_attention, 1, 2)  # S(2) 2x3x1x4
reshape = reshape.default(transpose_3, [2, 3, 4])  # S(2) 2x3x4
linear_1 = linear.default(reshape, p_out_weight)  # P 2x3x8
tp_g_0 = tp_g_0(linear_1)  # R 2x3x8  [g]
add_tensor = add.Tensor(tp_g_0, p_out_bias)  # R 2x3x8
add = add.Tensor(x, add_tensor)  # R 2x3x8
""")
