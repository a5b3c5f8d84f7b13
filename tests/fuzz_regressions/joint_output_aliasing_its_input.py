# Fuzz seed 3 under --joint-graph (before the fix): at p=2 the first chunk sends f(x) and x to the next, and f's
# output is a view of its input. AOT autograd returns an output that aliases by replaying its view outside the
# compiled function, so its gradient skipped f's backward all-reduce and the first chunk's gradients were wrong.
# Fix: each such output is copied before the export ([Note: an output that aliases] in passes/joint/export.py).
FUZZ_OPTIONS = {"joint_graph": True}
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {'H': 12, 'heads': 6, 'kv_heads': 6, 'F': 36, 'S': 8, 'layers': 4, 'vocab': 17, 'tied': True, 'p': 0.0, 'carry': True, 'regularize': False, 'head': True, 'side': False, 'loops': 1, 'no_grad': False}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin3 = nn.Linear(12, 12, bias=False)
        self.lin5 = nn.Linear(12, 12, bias=True)
        self.w7 = nn.Parameter(torch.randn(12, 12) / 3.4641)
        self.register_buffer('cos8', torch.cos(torch.arange(16.0).view(8, 2)))
        self.register_buffer('sin9', torch.sin(torch.arange(16.0).view(8, 2)))
        self.register_buffer('mask12', torch.tril(torch.ones(8, 8)).view(1, 1, 8, 8))
        self.w16 = nn.Parameter(torch.randn(2, 2) / 1.4142)
        self.w19 = nn.Parameter(torch.randn(12, 12) / 3.4641)
        self.w22 = nn.Parameter(torch.randn(36, 12) / 6.0000)
        self.conv24 = nn.Conv1d(36, 36, 3, groups=36, padding=2)
        self.w26 = nn.Parameter(torch.randn(36, 12) / 6.0000)
        self.w27 = nn.Parameter(torch.randn(12) / 1.0000)

    def forward(self, x, prev):
        h2 = self.lin3(x)
        h4 = self.lin5(x)
        h6 = x @ self.w7
        h2 = h2.view(x.shape[0], 8, 6, 2).transpose(1, 2)
        h4 = h4.view(x.shape[0], 8, 6, 2).transpose(1, 2)
        h6 = h6.view(x.shape[0], 8, 6, 2).transpose(1, 2)
        h2 = h2 * self.cos8 + torch.cat([-h2[..., 1:], h2[..., :1]], dim=-1) * self.sin9
        h4 = h4 * self.cos8 + torch.cat([-h4[..., 1:], h4[..., :1]], dim=-1) * self.sin9
        s11 = torch.einsum('bhid,bhjd->bhij', h2, h4) * 0.70711
        s11 = s11 + prev
        p13 = (s11.masked_fill(self.mask12 == 0, float('-inf'))).softmax(-1)
        y10 = p13 @ h6
        y10 = F.pad(y10, (0, 0, 0, 2))[:, :, :8]
        buf14 = torch.zeros_like(y10)
        buf14[:, :, :4] = y10[:, :, :4].tril()
        buf14[:, :, 4:] = y10[:, :, 4:]
        h15 = buf14 @ self.w16.t()
        m17 = h15.transpose(1, 2).reshape(x.shape[0], 8, 12)
        h18 = m17 @ self.w19.t()
        h21 = x @ self.w22.t()
        a23 = F.gelu(h21)
        a23 = self.conv24(a23.transpose(1, 2))[..., :8].transpose(1, 2)
        a23 = F.dropout(a23, 0.0, self.training)
        h25 = torch.einsum('bsh,hf->bsf', a23, self.w26) + self.w27
        x = x + h18 + h25
        return x, s11, None


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))
        self.wte = nn.Embedding(17, 12)
        self.head = nn.Linear(12, 17, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, inp, aux=None):
        x = self.wte(inp) if hasattr(self, 'wte') else inp
        x = x + 0.5 * (self.wte(aux) if hasattr(self, 'wte') else aux)
        prev = torch.zeros(x.shape[0], 6, 8, 8)
        side = []
        for layer in self.layers:
            x, prev, s = layer(x, prev)
            if s is not None:
                side.append(s)
        x = self.head(x)
        return (x, *side) if side else x


def example():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 17, (2, 8 + 1), generator=g)
    inp = base[:, :-1]
    aux = inp
    return (inp, aux), {}


def call():  # the inputs the check calls with, after tracing with example()
    g = torch.Generator().manual_seed(2)
    base = torch.randint(0, 17, (2, 8 + 1), generator=g)
    inp = base[:, :-1]
    aux = torch.randint(0, 17, (2, 8), generator=g)
    return (inp, aux), {}
