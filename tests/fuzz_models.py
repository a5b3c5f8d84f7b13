"""A generator of Transformer-like models nobody wrote by hand, for the differential fuzzer (tests/fuzz.py).

`generate(seed)` returns the Python source of a module defining `Model` (an nn.Module) and `example()` (its
example args and kwargs): a deterministic function of the seed, so a failing model is saved and rerun as a
standalone file. The grammar covers the op families the rules cover and the hazards of the soundness issue:

    GEMMs        nn.Linear, F.linear, x @ W.t(), x @ W, einsum('bsh,hf->bsf'), addmm on a flattened input, addmm
                 whose additive term is an activation or a broadcast column (with beta/alpha), a weight on the left
                 (W @ x^T)^T
    activations  relu, gelu (erf, tanh), GPT-2's NewGELU written out, silu, tanh, gated (SwiGLU, fused gate|up), a
                 causal depthwise conv1d over the tokens, or over q|k|v joined by cat (a linear-attention mixer)
    attention    fused Q|K|V split or viewed (B, S, 3, H, hd) and unbound, separate or grouped-query K/V (one GEMM
                 laid out per K/V group or as [q | k | v]; K/V expanded by repeat_interleave, by expand + reshape, or
                 read by SDPA(enable_gqa=True)), einsum attention, rotary (in an autocast region or not)
                 arithmetic, scores by matmul or einsum, causal masks (a buffer, triu built in the graph, additive),
                 SDPA, attention dropout, a chunked scan's writes (pad, tril, copy_ into a zeros_like buffer), a
                 per-head projection, scores carried into the next layer
    norms        LayerNorm, RMSNorm written out, statistics (var, std, mean, norm) on activations
    blocks       pre-norm, post-norm, parallel attention + MLP; a ModuleList of layers, in one model of ten applied
                 twice (each weight read by two GEMMs), the first time under no_grad in half of those
    hazards      a parameter read twice (regularizer), a weight shared by two GEMMs, a sharded value returned,
                 a mode-dependent branch, dropout, token embeddings tied or not, sizes t divides and not, a
                 second input that aliases the first at trace time (the same tensor, an overlapping view, by
                 keyword) and is distinct when called, or the reverse; inputs laid out sequence-first (S, B, ...),
                 as Megatron lays them out, transposed in the forward
    experts      in one model of eight (every one with `experts`, the fuzzer's --ep), the MLP is a mixture of
                 experts spelled as Hugging Face's are: a router (softmax then top-k, renormalized or not; top-k
                 then softmax; a sigmoid with a selection bias), k, sorted (token, expert) pairs and histc offsets,
                 grouped expert GEMMs over [E, out, in] or [E, in, out] weights (or batched_mm's: the pairs in
                 order, each by its expert's gathered weights), gated (chunked, or interleaved
                 and clamped as GPT-OSS's) or not, per-expert biases, a skewed router, a shared expert beside it
    refusals     in about one model of fifty, the MLP's hidden activation goes through a custom autograd.Function
                 (a straight-through rounding, or an identity whose backward scales the gradient) whose `apply` is
                 bound before the trace: in the layer's __init__, at module level, or by functools.partial. A
                 trace keeps its forward only, so fxpar must refuse it: the source says so in `EXPECT_REFUSAL`, and
                 the fuzzer counts any other outcome as a failure ("unrefused")

`example(rows=2)` and `call(rows=2)` take the batch size: the fuzzer's loss mode calls them with a whole global
batch (tests/fuzz.py --loss). The hazards added after the first grammar draw from a second generator
(`_hazards(seed)`), and the looped blocks, the layout, the custom Functions and the experts from generators of their
own, so the models of the seeds that came before keep their structure (but for the one in eight that became a
mixture of experts).
"""
from __future__ import annotations

import ast
import linecache
import random
import re
from dataclasses import dataclass, field

from tests.fuzz_experts import GMM_SOURCE, ExpertGrammar, experts_of


@dataclass
class _Code:
    init: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    n: int = 0

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


class _Layer(ExpertGrammar):
    """Emits one layer's __init__ and forward lines over the residual stream `x` of shape (B, S, H)."""

    def __init__(self, rng: random.Random, cfg: dict, hazards: random.Random, experts: random.Random | None = None):
        self.r, self.c, self.code, self.h, self.e = rng, cfg, _Code(), hazards, experts
        self.side = None  # a hidden activation the model also returns

    def param(self, *shape) -> str:
        name = self.code.name("w")
        fan = shape[0] if len(shape) > 1 else 1
        self.code.init.append(f"self.{name} = nn.Parameter(torch.randn({', '.join(map(str, shape))}) / {fan ** 0.5:.4f})")
        return f"self.{name}"

    def emit(self, line: str) -> None:
        self.code.body.append(line)

    def gemm(self, inp: str, fin: int, fout: int, bias: bool | None = None, batched: bool = False) -> str:
        """inp (B, S, fin) -> (B, S, fout) in a random spelling; `batched`: inp has more leading dims (per head)."""
        r, out = self.r, self.code.name("h")
        if self.h.random() < 0.12:
            return self.odd_gemm(inp, fin, fout, batched, out)
        bias = r.random() < 0.5 if bias is None else bias
        spellings = ["linear", "linear", "F.linear", "wt", "w"] + ([] if batched else ["einsum", "addmm"])
        spelling = r.choice(spellings)
        if spelling == "linear":
            mod = self.code.name("lin")
            self.code.init.append(f"self.{mod} = nn.Linear({fin}, {fout}, bias={bias})")
            self.emit(f"{out} = self.{mod}({inp})")
            return out
        w = self.param(fin, fout) if spelling in ("w", "einsum", "addmm") else self.param(fout, fin)
        b = self.param(fout) if bias or spelling == "addmm" else None
        if spelling == "F.linear":
            self.emit(f"{out} = F.linear({inp}, {w}{', ' + b if b else ''})")
        elif spelling == "wt":
            self.emit(f"{out} = {inp} @ {w}.t(){' + ' + b if b else ''}")
        elif spelling == "w":
            self.emit(f"{out} = {inp} @ {w}{' + ' + b if b else ''}")
        elif spelling == "einsum":
            self.emit(f"{out} = torch.einsum('bsh,hf->bsf', {inp}, {w}){' + ' + b if b else ''}")
        else:
            self.emit(f"{out} = torch.addmm({b}, {inp}.flatten(0, 1), {w}).view({inp}.shape[0], {inp}.shape[1], "
                      f"{fout})")
        return out

    def odd_gemm(self, inp: str, fin: int, fout: int, batched: bool, out: str) -> str:
        """A weight on the left, (W @ x^T)^T, or addmm with an additive term that is not a bias: an activation (the
        input when fin == fout, else a second GEMM of it) or a broadcast column, with or without beta/alpha."""
        h = self.h
        if batched or h.random() < 0.4:
            w = self.param(fout, fin)
            self.emit(f"{out} = ({w} @ {inp}.transpose(-2, -1)).transpose(-2, -1)")
            return out
        flat = f"{inp}.flatten(0, 1)"
        w = self.param(fin, fout)
        term = h.choice(["column", "activation"])
        if term == "column":
            add = f"{flat}.mean(-1, keepdim=True)"
        elif fin == fout:
            add = flat
        else:
            add = f"({flat} @ {self.param(fin, fout)})"
        # alpha below 1: a gated MLP squares its scale layer after layer, and alpha=2 over 4 layers gave outputs of
        # 2e19, whose sine is noise in float64 too (seed 3043 of the first long run: a chaotic model, not a rewrite)
        scale = h.choice(["", "", ", beta=0.5", ", alpha=0.5", ", beta=2.0, alpha=0.5"])
        self.emit(f"{out} = torch.addmm({add}, {flat}, {w}{scale}).view({inp}.shape[0], {inp}.shape[1], {fout})")
        return out

    def act(self, h: str) -> str:
        out = self.code.name("a")
        kind = self.r.choice(["relu", "gelu", "gelu_tanh", "newgelu", "silu", "tanh", "none"])
        expr = {"relu": f"F.relu({h})", "gelu": f"F.gelu({h})", "gelu_tanh": f"F.gelu({h}, approximate='tanh')",
                "newgelu": f"0.5 * {h} * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * ({h} + 0.044715 * "
                           f"torch.pow({h}, 3.0))))",
                "silu": f"F.silu({h})", "tanh": f"torch.tanh({h})", "none": h}[kind]
        self.emit(f"{out} = {expr}")
        return out

    def custom_function(self, h: str) -> str:
        """h through the model's custom autograd.Function (FUNCTIONS), its `apply` reached as c["function"] says:
        bound in __init__, at module level (the alias FUNCTIONS names), or by functools.partial."""
        cls, way = self.c["function"]
        _, const, alias = FUNCTIONS[cls]
        out = self.code.name("q")
        if way == "module":
            self.emit(f"{out} = {alias}({const}, {h})")
            return out
        fn = self.code.name("fn")
        if way == "init":
            self.code.init.append(f"self.{fn} = {cls}.apply")
            self.emit(f"{out} = self.{fn}({const}, {h})")
        else:
            self.code.init.append(f"self.{fn} = functools.partial({cls}.apply, {const})")
            self.emit(f"{out} = self.{fn}({h})")
        return out

    def dropout(self, h: str) -> str:
        if self.r.random() < 0.3:
            self.emit(f"{h} = F.dropout({h}, {self.c['p']}, self.training)")
        return h

    def norm(self, x: str) -> str:
        H, kind, out = self.c["H"], self.r.choice(["layer", "rms", "stats", "none"]), self.code.name("n")
        if kind == "layer":
            mod = self.code.name("ln")
            self.code.init.append(f"self.{mod} = nn.LayerNorm({H})")
            self.emit(f"{out} = self.{mod}({x})")
        elif kind == "rms":
            w = self.param(H)
            self.emit(f"{out} = {x} * torch.rsqrt({x}.pow(2).mean(-1, keepdim=True) + 1e-6) * {w}")
        elif kind == "stats":
            self.emit(f"{out} = ({x} - {x}.mean(-1, keepdim=True)) / ({x}.var(-1, keepdim=True, unbiased=False) + "
                      "1e-5).sqrt()")
        else:
            return x
        return out

    def mlp(self, x: str) -> str:
        H, F = self.c["H"], self.c["F"]
        if self.c["moe"]:
            return self.dropout(self.moe(x))
        if self.r.random() < 0.3:  # gated: fused gate|up or two GEMMs
            if self.r.random() < 0.5:
                gu = self.gemm(x, H, 2 * F, bias=False)
                g, u = self.code.name("g"), self.code.name("u")
                self.emit(f"{g}, {u} = {gu}.chunk(2, dim=-1)")
            else:
                g, u = self.gemm(x, H, F, bias=False), self.gemm(x, H, F, bias=False)
            h = self.code.name("h")
            self.emit(f"{h} = F.silu({g}) * {u}")
        else:
            h = self.act(self.gemm(x, H, F))
        if self.c["function"]:
            h = self.custom_function(h)
        if self.r.random() < 0.15:  # statistics of the hidden activation
            op = self.r.choice(["var(1, keepdim=True, unbiased=False)", "std(1, keepdim=True)", "mean(1, keepdim=True)",
                                "norm(dim=1, keepdim=True)"])
            self.emit(f"{h} = {h} / (1 + {h}.{op}.abs())")
        if self.r.random() < 0.15:  # a causal depthwise conv over the tokens (a hybrid layer's short convolution)
            conv = self.code.name("conv")
            self.code.init.append(f"self.{conv} = nn.Conv1d({F}, {F}, 3, groups={F}, padding=2)")
            self.emit(f"{h} = self.{conv}({h}.transpose(1, 2))[..., :{self.c['S']}].transpose(1, 2)")
        if self.c["side"] and self.side is None:
            self.side = h  # a hidden activation returned by the model: a sharded value reaching the output
        return self.dropout(self.gemm(self.dropout(h), F, H))

    def attention(self, x: str, prev: str | None) -> tuple[str, str | None]:
        c, r = self.c, self.r
        H, nh, kvh, S = c["H"], c["heads"], c["kv_heads"], c["S"]
        hd = H // nh
        style = r.choice(["split", "view3", "separate", "separate", "per_group", "flat"])
        expanded = False  # k, v already have the query heads
        if style == "per_group":  # one GEMM laid out per K/V group: [kvh, nh/kvh + 2, hd]
            qkv = self.gemm(x, H, (nh + 2 * kvh) * hd)
            q, k, v = (self.code.name(p) for p in "qkv")
            self.emit(f"{q}, {k}, {v} = {qkv}.view({x}.shape[0], {S}, {kvh}, {nh // kvh + 2}, {hd})"
                      f".split([{nh // kvh}, 1, 1], dim=3)")
            for t, heads in ((q, nh), (k, kvh), (v, kvh)):
                self.emit(f"{t} = {t}.reshape({x}.shape[0], {S}, {heads}, {hd}).transpose(1, 2)")
        elif style == "flat":  # one GEMM, [q | k | v] of sizes [nh hd, kvh hd, kvh hd]
            qkv = self.gemm(x, H, (nh + 2 * kvh) * hd)
            q, k, v = (self.code.name(p) for p in "qkv")
            self.emit(f"{q}, {k}, {v} = {qkv}.split([{nh * hd}, {kvh * hd}, {kvh * hd}], dim=-1)")
            for t, heads in ((q, nh), (k, kvh), (v, kvh)):
                self.emit(f"{t} = {t}.view({x}.shape[0], {S}, {heads}, {hd}).transpose(1, 2)")
        elif style == "split" and kvh == nh:
            qkv = self.gemm(x, H, 3 * H)
            q, k, v = (self.code.name(p) for p in "qkv")
            self.emit(f"{q}, {k}, {v} = {qkv}.split({H}, dim=2)")
            for t in (q, k, v):
                self.emit(f"{t} = {t}.view({x}.shape[0], {S}, {nh}, {hd}).transpose(1, 2)")
        elif style == "view3" and kvh == nh:
            qkv = self.gemm(x, H, 3 * H)
            q, k, v = (self.code.name(p) for p in "qkv")
            self.emit(f"{q}, {k}, {v} = {qkv}.view({x}.shape[0], {S}, 3, {nh}, {hd}).permute(2, 0, 3, 1, 4)"
                      ".unbind(0)")
        else:
            q, k, v = self.gemm(x, H, H), self.gemm(x, H, kvh * hd), self.gemm(x, H, kvh * hd)
            if self.h.random() < 0.2:  # joined for one depthwise conv over q|k|v channels (a linear-attention mixer)
                n, conv = H + 2 * kvh * hd, self.code.name("conv")
                self.code.init.append(f"self.{conv} = nn.Conv1d({n}, {n}, 3, groups={n}, padding=2)")
                self.emit(f"{q} = F.silu(self.{conv}(torch.cat([{q}, {k}, {v}], dim=-1).transpose(1, 2))[..., :{S}])"
                          ".transpose(1, 2)")
                self.emit(f"{q}, {k}, {v} = {q}.split([{H}, {kvh * hd}, {kvh * hd}], dim=-1)")
            for t, heads in ((q, nh), (k, kvh), (v, kvh)):
                self.emit(f"{t} = {t}.view({x}.shape[0], {S}, {heads}, {hd}).transpose(1, 2)")
        sdpa = r.random() < 0.25 and prev is None
        if kvh != nh and not (sdpa and r.random() < 0.4):  # else SDPA(enable_gqa=True) reads the groups
            expanded, rep = True, nh // kvh
            for t in (k, v):
                if r.random() < 0.5:
                    self.emit(f"{t} = {t}.repeat_interleave({rep}, dim=1)")
                else:
                    self.emit(f"{t} = {t}[:, :, None].expand({x}.shape[0], {kvh}, {rep}, {S}, {hd})"
                              f".reshape({x}.shape[0], {nh}, {S}, {hd})")
        if r.random() < 0.3 and hd % 2 == 0:  # rotary arithmetic with cos/sin buffers
            cos, sin = self.code.name("cos"), self.code.name("sin")
            self.code.init.append(f"self.register_buffer('{cos}', torch.cos(torch.arange({S * hd}.0).view({S}, {hd})))")
            self.code.init.append(f"self.register_buffer('{sin}', torch.sin(torch.arange({S * hd}.0).view({S}, {hd})))")
            region = r.random() < 0.4  # in an autocast region with autocast off, as training code writes it
            if region:
                self.emit("with torch.autocast('cpu', enabled=False):")
            for t in (q, k):
                half = hd // 2
                self.emit(f"{'    ' if region else ''}{t} = {t} * self.{cos} + torch.cat([-{t}[..., {half}:], "
                          f"{t}[..., :{half}]], dim=-1) * self.{sin}")
        y, scores = self.code.name("y"), None
        mask = r.choice(["none", "buffer", "triu", "additive"])
        if sdpa:
            causal = ", is_causal=True" if mask != "none" else ""
            gqa = ", enable_gqa=True" if kvh != nh and not expanded else ""
            self.emit(f"{y} = F.scaled_dot_product_attention({q}, {k}, {v}{causal}{gqa})")
        else:
            scores = self.code.name("s")
            if r.random() < 0.5:
                self.emit(f"{scores} = ({q} @ {k}.transpose(-2, -1)) * {hd ** -0.5:.5f}")
            else:
                self.emit(f"{scores} = torch.einsum('bhid,bhjd->bhij', {q}, {k}) * {hd ** -0.5:.5f}")
            if prev is not None:
                self.emit(f"{scores} = {scores} + {prev}")
            if mask == "buffer":
                m = self.code.name("mask")
                self.code.init.append(f"self.register_buffer('{m}', torch.tril(torch.ones({S}, {S})).view(1, 1, {S}, "
                                      f"{S}))")
                probs_in = f"{scores}.masked_fill(self.{m} == 0, float('-inf'))"
            elif mask == "triu":
                probs_in = f"{scores}.masked_fill(torch.triu(torch.ones({S}, {S}, dtype=torch.bool), 1), float('-inf'))"
            elif mask == "additive":
                probs_in = f"{scores} + torch.triu(torch.full(({S}, {S}), -1e4), 1)"
            else:
                probs_in = scores
            p = self.code.name("p")
            self.emit(f"{p} = ({probs_in}).softmax(-1)")
            p = self.dropout(p)
            if r.random() < 0.5:
                self.emit(f"{y} = {p} @ {v}")
            else:
                self.emit(f"{y} = torch.einsum('bhij,bhjd->bhid', {p}, {v})")
        if self.h.random() < 0.15:  # a chunked scan's writes: padded to whole chunks, each copied into a buffer
            buf, half = self.code.name("buf"), S // 2
            self.emit(f"{y} = F.pad({y}, (0, 0, 0, 2))[:, :, :{S}]")
            self.emit(f"{buf} = torch.zeros_like({y})")
            self.emit(f"{buf}[:, :, :{half}] = {y}[:, :, :{half}].tril()")
            self.emit(f"{buf}[:, :, {half}:] = {y}[:, :, {half}:]")
            y = buf
        if r.random() < 0.15:  # a per-head projection before the heads merge
            y = self.gemm(y, hd, hd, batched=True)
        merged = self.code.name("m")
        self.emit(f"{merged} = {y}.transpose(1, 2).reshape({x}.shape[0], {S}, {H})")
        return self.dropout(self.gemm(merged, H, H)), scores

    def build(self, carry_scores: bool) -> _Code:
        """The layer: x (and the previous layer's scores) -> x (and its scores)."""
        kind = self.r.choice(["pre", "pre", "post", "parallel"])
        a, scores = self.attention(self.norm("x"), "prev" if carry_scores else None)
        if kind == "parallel":
            n = self.norm("x")
            self.emit(f"x = x + {a} + {self.mlp(n)}")
        elif kind == "post":
            n = self.norm(f"(x + {a})")
            self.emit(f"x = {n} + {self.mlp(n)}")
        else:
            self.emit(f"x = x + {a}")
            self.emit(f"x = x + {self.mlp(self.norm('x'))}")
        if self.r.random() < 0.1:
            self.emit("x = x * 1.5 if self.training else x")  # a mode-dependent branch
        self.emit(f"return x, {scores if carry_scores and scores else 'prev'}, {self.side or 'None'}")
        return self.code


def _config(r: random.Random) -> dict:
    H = r.choice([8, 12, 16, 16, 24])
    heads = r.choice([d for d in (1, 2, 3, 4, 6, 8) if H % d == 0 and H // d >= 2])
    kv_heads = r.choice([d for d in (1, 2, heads) if heads % d == 0])
    F = r.choice([2 * H, 3 * H, 4 * H, 2 * H + 1])
    vocab = r.choice([0, 16, 17, 32])
    return dict(H=H, heads=heads, kv_heads=kv_heads, F=F, S=r.choice([4, 8]), layers=r.choice([1, 2, 2, 3, 4]),
                vocab=vocab, tied=bool(vocab) and r.random() < 0.5, p=0.0, carry=r.random() < 0.1,
                regularize=r.random() < 0.1, head=r.random() < 0.7, side=r.random() < 0.08)


_STRAIGHT_THROUGH = '''
class StraightThrough(torch.autograd.Function):
    """Rounds to multiples of `step` in the forward; passes the gradient through unchanged in the backward."""

    @staticmethod
    def forward(ctx, step, x):
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad):
        return None, grad
'''
_SCALED_GRAD = '''
class ScaledGrad(torch.autograd.Function):
    """The identity in the forward; scales the gradient by `scale` in the backward."""

    @staticmethod
    def forward(ctx, scale, x):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad * ctx.scale
'''
# class name -> (its source, its first argument, the module-level alias of its apply)
FUNCTIONS = {"StraightThrough": (_STRAIGHT_THROUGH, "0.25", "straight_through"),
             "ScaledGrad": (_SCALED_GRAD, "0.5", "scaled_grad")}
EXPECTED = "custom autograd.Function"  # what fxpar's refusal of a model with one of FUNCTIONS names


def expected_refusal(source: str) -> str | None:
    """What fxpar must refuse a generated source for (its EXPECT_REFUSAL), or None."""
    found = re.search(r"^EXPECT_REFUSAL = (.*?)(  #.*)?$", source, re.M)
    return ast.literal_eval(found.group(1)) if found else None


def _hazards(seed: int) -> random.Random:
    return random.Random(f"fxpar hazards {seed}")


_ALIASINGS = ["none", "none", "same", "view"]  # how the second input relates to the first, in a call


def _inputs(c: dict, how: str, seed: int, by_name: bool) -> list[str]:
    """The lines of a function body returning (args, kwargs): the first input, and a second one (`aux`) that is a
    fresh tensor, the same tensor, or an overlapping view of the first's storage ([Note: inputs are traced
    distinct] in fxpar/trace.py)."""
    first, rest = ("[:-1]", "[1:]") if c["seq_first"] else ("[:, :-1]", "[:, 1:]")
    lines = [f"    g = torch.Generator().manual_seed({seed})", f"    base = {_draw(c, c['S'] + 1)}",
             f"    inp = base{first}",
             {"none": f"    aux = {_draw(c, c['S'])}", "same": "    aux = inp", "view": f"    aux = base{rest}"}[how]]
    return lines + ["    return (inp,), {'aux': aux}" if by_name else "    return (inp, aux), {}"]


def _draw(c: dict, tokens: int) -> str:
    """A fresh input of `rows` rows (the function's parameter) over `tokens` tokens: ids, or activations of the
    hidden size; (tokens, rows, ...) where the model takes its inputs sequence-first."""
    size = f"{tokens}, rows" if c["seq_first"] else f"rows, {tokens}"
    return f"torch.randint(0, {c['vocab']}, ({size}), generator=g)" if c["vocab"] else \
        f"torch.randn({size}, {c['H']}, generator=g)"


def generate(seed: int, experts: bool = False) -> str:
    """The source of one random model (see the module docstring); `experts`: its MLPs are mixtures of experts."""
    r, hazards = random.Random(seed), _hazards(seed)
    c = _config(r)
    c["moe"] = experts_of(seed, experts)
    aliasing = hazards.random() < 0.25  # a second input, aliasing the first in the example or in the call
    layout, functions = random.Random(f"fxpar layout {seed}"), random.Random(f"fxpar functions {seed}")
    c["seq_first"] = layout.random() < 0.05
    c["function"] = (functions.choice(sorted(FUNCTIONS)), functions.choice(["init", "module", "partial"])) \
        if functions.random() < 0.02 and not c["moe"] else None  # (a dense MLP's hidden activation goes through it)
    layer = _Layer(r, c, hazards, random.Random(f"fxpar expert spellings {seed}")).build(c["carry"])
    loops = random.Random(f"fxpar loops {seed}")  # its own stream: the models of other seeds stay as they were
    c["loops"], c["no_grad"] = (2, loops.random() < 0.5) if loops.random() < 0.1 else (1, False)
    H, S, V = c["H"], c["S"], c["vocab"]
    lines = ["import functools", "import math", "import torch", "import torch.nn as nn",
             "import torch.nn.functional as F", "", f"CONFIG = {c!r}",
             f"SEED = {seed}  # the generator's (tests/fuzz.py --loss draws the targets from it)"]
    if c["function"]:
        name, way = c["function"]
        source, _, alias = FUNCTIONS[name]
        lines += [f"EXPECT_REFUSAL = {EXPECTED!r}  # a trace keeps the Function's forward only", "",
                  *source.splitlines(),
                  *(["", "", f"{alias} = {name}.apply  # bound at module level, before any trace"] if way == "module"
                    else [])]
    if c["moe"]:
        lines += GMM_SOURCE.splitlines()
    lines += ["", "", "class Layer(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += [f"        {line}" for line in layer.init] or ["        pass"]
    lines += ["", "    def forward(self, x, prev):"] + [f"        {line}" for line in layer.body]
    lines += ["", "", "class Model(nn.Module):", "    def __init__(self):", "        super().__init__()",
              f"        self.layers = nn.ModuleList(Layer() for _ in range({c['layers']}))"]
    if V:
        lines.append(f"        self.wte = nn.Embedding({V}, {H})")
    if c["head"] or c["tied"]:
        lines.append(f"        self.head = nn.Linear({H}, {V or H}, bias={not c['tied']})")
        if c["tied"]:
            lines.append("        self.head.weight = self.wte.weight")
    forward = "    def forward(self, inp, aux=None):" if aliasing else "    def forward(self, inp):"
    lines += ["", forward,
              *[f"        {v} = {v}.transpose(0, 1)  # sequence-first inputs, as Megatron lays them out"
                for v in ("inp", "aux")[:1 + aliasing] if c["seq_first"]],
              "        x = self.wte(inp) if hasattr(self, 'wte') else inp",
              *(["        x = x + 0.5 * (self.wte(aux) if hasattr(self, 'wte') else aux)"] if aliasing else []),
              f"        prev = torch.zeros(x.shape[0], {c['heads']}, {S}, {S})", "        side = []",
              *([f"        with torch.set_grad_enabled({not c['no_grad']}):",  # the same layers applied twice
                 "            for layer in self.layers:", "                x, prev, s = layer(x, prev)",
                 # the second pass starts from unit scale, as the first does: twice the depth of residual blocks
                 # whose MLP reads the unnormalized stream would otherwise overflow float32 (seeds 9300066, 9300246)
                 f"        x = F.layer_norm(x, ({H},))"]
                if c["loops"] > 1 else []),
              "        for layer in self.layers:", "            x, prev, s = layer(x, prev)",
              "            if s is not None:", "                side.append(s)"]
    if c["head"] or c["tied"]:
        lines.append("        x = self.head(x)")
    if c["regularize"]:
        lines.append("        x = x + 1e-3 * sum(p.pow(2).sum() for p in self.layers[0].parameters())")
    lines += ["        return (x, *side) if side else x", "", ""]
    if aliasing:  # traced with one aliasing of (inp, aux), called with another
        traced, called = hazards.sample(_ALIASINGS, 2)
        by_name = hazards.random() < 0.5
        lines += ["def example(rows=2):", *_inputs(c, traced, 1, by_name), "", "",
                  "def call(rows=2):  # the inputs the check calls with, after tracing with example()",
                  *_inputs(c, called, 2, by_name)]
    else:
        lines += ["def example(rows=2):", "    g = torch.Generator().manual_seed(1)",
                  f"    return ({_draw(c, S)},), {{}}"]
    return "\n".join(lines) + "\n"


def load(source: str):
    """(Model class, example function, call function) of a generated source, in a namespace of its own; the call
    function gives the inputs to check with (the example's, unless the source defines `call`). The source's lines
    go into linecache, so that a refusal or a traceback quotes the model's own line."""
    namespace: dict = {}
    name = "<fxpar fuzz model>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace["Model"], namespace["example"], namespace.get("call", namespace["example"])
