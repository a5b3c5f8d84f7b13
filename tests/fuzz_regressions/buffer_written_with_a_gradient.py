# Fuzz seed 84 (found when the grammar gained a chunked scan's writes): a buffer made by zeros_like, filled by
# copy_ into its slices with the attention's output, then read by a column-parallel GEMM (a per-head projection).
# grad_nodes saw zeros_like as gradient-free (it reads only a shape), so no f entered the region there and the
# attention's weights got a per-rank partial gradient. Fix: a storage written with a gradient-carrying value carries
# gradient from then on (grad_nodes in passes/sharding/analysis.py).
# t=2: forward gap 8.82e-17, parameters after SGD 0.0155
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {'H': 16, 'heads': 1, 'kv_heads': 1, 'F': 32, 'S': 4, 'layers': 3, 'vocab': 17, 'tied': True, 'p': 0.0, 'carry': False, 'regularize': False, 'head': True, 'side': False}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w3 = nn.Parameter(torch.randn(16, 16) / 4.0000)
        self.lin5 = nn.Linear(16, 16, bias=True)
        self.w7 = nn.Parameter(torch.randn(16, 16) / 4.0000)
        self.w8 = nn.Parameter(torch.randn(16) / 1.0000)
        self.w12 = nn.Parameter(torch.randn(16, 16) / 4.0000)
        self.lin15 = nn.Linear(16, 16, bias=False)
        self.w18 = nn.Parameter(torch.randn(32, 16) / 5.6569)
        self.lin20 = nn.Linear(16, 32, bias=False)
        self.conv22 = nn.Conv1d(32, 32, 3, groups=32, padding=2)
        self.lin24 = nn.Linear(32, 16, bias=False)

    def forward(self, x, prev):
        h2 = torch.einsum('bsh,hf->bsf', x, self.w3)
        h4 = self.lin5(x)
        h6 = x @ self.w7.t() + self.w8
        h2 = h2.view(x.shape[0], 4, 1, 16).transpose(1, 2)
        h4 = h4.view(x.shape[0], 4, 1, 16).transpose(1, 2)
        h6 = h6.view(x.shape[0], 4, 1, 16).transpose(1, 2)
        y9 = F.scaled_dot_product_attention(h2, h4, h6, is_causal=True)
        y9 = F.pad(y9, (0, 0, 0, 2))[:, :, :4]
        buf10 = torch.zeros_like(y9)
        buf10[:, :, :2] = y9[:, :, :2].tril()
        buf10[:, :, 2:] = y9[:, :, 2:]
        h11 = F.linear(buf10, self.w12)
        m13 = h11.transpose(1, 2).reshape(x.shape[0], 4, 16)
        h14 = self.lin15(m13)
        h14 = F.dropout(h14, 0.0, self.training)
        h17 = F.linear((x + h14), self.w18)
        h19 = self.lin20((x + h14))
        h21 = F.silu(h17) * h19
        h21 = self.conv22(h21.transpose(1, 2))[..., :4].transpose(1, 2)
        h21 = F.dropout(h21, 0.0, self.training)
        h23 = self.lin24(h21)
        x = (x + h14) + h23
        return x, prev, None


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.wte = nn.Embedding(17, 16)
        self.head = nn.Linear(16, 17, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, inp, aux=None):
        x = self.wte(inp) if hasattr(self, 'wte') else inp
        x = x + 0.5 * (self.wte(aux) if hasattr(self, 'wte') else aux)
        prev = torch.zeros(x.shape[0], 1, 4, 4)
        side = []
        for layer in self.layers:
            x, prev, s = layer(x, prev)
            if s is not None:
                side.append(s)
        x = self.head(x)
        return (x, *side) if side else x


def example():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 17, (2, 4 + 1), generator=g)
    inp = base[:, :-1]
    aux = torch.randint(0, 17, (2, 4), generator=g)
    return (inp,), {'aux': aux}


def call():  # the inputs the check calls with, after tracing with example()
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 17, (2, 4 + 1), generator=g)
    inp = base[:, :-1]
    aux = inp
    return (inp,), {'aux': aux}

