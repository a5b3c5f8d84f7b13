"""The fuzzer's mixtures of experts (tests/fuzz_models.py): a layer's MLP as Hugging Face's grouped experts spell it,
with the router, the sorting and the weighted sum over k written out, in one model of eight (`experts_of`), and in
every model of the fuzzer's --ep mode."""
from __future__ import annotations

import random

GMM_SOURCE = '''
import transformers.integrations.moe  # noqa: E402,F401 - registers torch.ops.transformers.grouped_mm_fallback


def gmm(x, w, offs):
    """Each expert's rows times its weight, as Hugging Face's experts call it in float32 and float64 (torch's own
    kernel, which they call in bf16, has no float32 trace: its meta function wants bf16)."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs=offs)
'''


def experts_of(seed: int, force: bool) -> dict | None:
    """A mixture-of-experts MLP's sizes and spellings, in one model of eight (every model where `force`), from a
    stream of its own."""
    g = random.Random(f"fxpar experts {seed}")
    if not (g.random() < 0.125 or force):
        return None
    E = g.choice([2, 4, 4, 8])
    return dict(E=E, k=g.choice([k for k in (1, 2, 3) if k <= E]), F=g.choice([4, 8, 12, 9]),
                router=g.choice(["softmax", "topk_softmax", "sigmoid"]), skew=g.random() < 0.25,
                shared=g.random() < 0.3, batched=g.random() < 0.3)


class ExpertGrammar:
    """The mixture-of-experts MLP of a generated layer (tests/fuzz_models.py _Layer, which mixes this in): `self.e`
    is the experts' own random stream, `self.c["moe"]` their sizes (experts_of)."""

    def expert_weight(self, e: int, fin: int, fout: int) -> str:
        """An expert GEMM's weight, [E, out, in] read through a transpose or [E, in, out] read as it is."""
        name = self.code.name("we")
        stored = (e, fout, fin) if self.e.random() < 0.5 else (e, fin, fout)
        self.code.init.append(f"self.{name} = nn.Parameter(torch.randn{stored} / {fin ** 0.5:.4f})")
        return f"self.{name}" + (".transpose(-2, -1)" if stored[1] == fout else "")

    def expert_gemm(self, inp: str, e: int, fin: int, fout: int, ids: str, offs: str | None) -> str:
        """inp's rows by their experts' weights: one grouped GEMM over rows sorted by expert (`offs`), or, with
        offs None, Hugging Face's batched_mm: each row by its own expert's weights gathered by `ids`."""
        w, out = self.expert_weight(e, fin, fout), self.code.name("h")
        if offs is not None:
            self.emit(f"{out} = gmm({inp}, {w}, {offs})")
        elif w.endswith(".transpose(-2, -1)"):  # stored [E, out, in]: W[ids] [S, out, in] @ inp [S, in, 1]
            self.emit(f"{out} = torch.bmm({w.removesuffix('.transpose(-2, -1)')}[{ids}], {inp}.unsqueeze(-1))"
                      ".squeeze(-1)")
        else:  # stored [E, in, out]: inp [S, 1, in] @ W[ids] [S, in, out]
            self.emit(f"{out} = torch.bmm({inp}.unsqueeze(1), {w}[{ids}]).squeeze(1)")
        return out

    def expert_bias(self, e: int, n: int, h: str, ids: str) -> str:
        """h plus a per-expert bias gathered by the rows' experts (GPT-OSS), out of place or in place as Hugging
        Face adds it."""
        b = self.code.name("be")
        self.code.init.append(f"self.{b} = nn.Parameter(torch.randn({e}, {n}) / 4)")
        if self.e.random() < 0.5:
            self.emit(f"{h}.add_(self.{b}[{ids}])")
            return h
        out = self.code.name("h")
        self.emit(f"{out} = {h} + self.{b}[{ids}]")
        return out

    def router(self, t: str, m: dict) -> tuple[str, str]:
        """(the k weights, the k expert ids) of each token row of t: softmax then top-k (renormalized or not),
        top-k of the logits then softmax over k, or a sigmoid whose top-k adds a selection bias (DeepSeek-V3);
        a skewed router sends most rows to expert 0 and none to the last ep block of experts."""
        E, k, H, g = m["E"], m["k"], self.c["H"], self.e
        logits = self.code.name("lg")
        wr = self.code.name("wr")
        self.code.init.append(f"self.{wr} = nn.Parameter(torch.randn({E}, {H}) / {H ** 0.5:.4f})")
        bias = ""
        if m["skew"] or g.random() < 0.3:
            br = self.code.name("br")
            values = [4.0 if i == 0 and m["skew"] else -50.0 if m["skew"] and i >= E // 2 else 0.0 for i in range(E)]
            self.code.init.append(f"self.{br} = nn.Parameter(torch.tensor({values}))")
            bias = f" + self.{br}"
        self.emit(f"{logits} = {t} @ self.{wr}.t(){bias}")
        w, ids = self.code.name("rw"), self.code.name("ids")
        kind = m["router"]
        if kind == "softmax":
            p = self.code.name("p")
            self.emit(f"{p} = {logits}.softmax(-1)")
            self.emit(f"{w}, {ids} = torch.topk({p}, {k}, dim=-1)")
            if g.random() < 0.5:
                self.emit(f"{w} = {w} / {w}.sum(-1, keepdim=True)")
        elif kind == "topk_softmax":
            top = self.code.name("top")
            self.emit(f"{top}, {ids} = {logits}.topk({k}, dim=-1)")
            self.emit(f"{w} = {top}.softmax(-1)")
        else:
            sb, s = self.code.name("sb"), self.code.name("sg")
            self.code.init.append(f"self.register_buffer('{sb}', torch.randn({E}) / 10)")
            self.emit(f"{s} = {logits}.sigmoid()")
            self.emit(f"{ids} = ({s} + self.{sb}).topk({k}, dim=-1)[1]")
            self.emit(f"{w} = {s}.gather(-1, {ids})")
            self.emit(f"{w} = {w} / ({w}.sum(-1, keepdim=True) + 1e-20) * 2.5")
        return w, ids

    def moe(self, x: str) -> str:
        """A mixture-of-experts MLP spelled as Hugging Face's grouped experts are: the router, the (token, expert)
        pairs sorted by expert, offsets counted by histc, the expert GEMMs (`gmm`) with the ops between them, the
        results weighted, back in token order and summed over k; a shared expert beside it in some."""
        m, g, H = self.c["moe"], self.e, self.c["H"]
        E, k, F = m["E"], m["k"], m["F"]
        t = self.code.name("t")
        self.emit(f"{t} = {x}.reshape(-1, {H})")
        w, ids = self.router(t, m)
        fi = self.code.name("fi")
        self.emit(f"{fi} = {ids}.reshape(-1)")
        if m.get("batched"):  # the (token, k) rows in order, each by its own expert's weights
            xs, sw, sid, offs = self.code.name("xr"), self.code.name("sw"), fi, None
            self.emit(f"{xs} = {t}.repeat_interleave({k}, dim=0)")
            self.emit(f"{sw} = {w}.reshape(-1)")
        else:
            sid, perm, xs, sw, offs = (self.code.name(p) for p in ("sid", "perm", "xs", "sw", "offs"))
            self.emit(f"{sid}, {perm} = torch.sort({fi}{', stable=True' if g.random() < 0.5 else ''})")
            self.emit(f"{xs} = {t}[{perm} // {k}]")
            self.emit(f"{sw} = {w}.reshape(-1)[{perm}]")
            self.emit(f"{offs} = torch.cumsum(torch.histc({sid}.float(), bins={E}, min=0, max={E - 1}), dim=0, "
                      "dtype=torch.int32)")
        gated = g.choice(["chunk", "interleaved", "none"])
        h1 = self.expert_gemm(xs, E, H, 2 * F if gated != "none" else F, sid, offs)
        if g.random() < 0.3:
            h1 = self.expert_bias(E, 2 * F if gated != "none" else F, h1, sid)
        if gated == "chunk":
            a, u, h = self.code.name("g"), self.code.name("u"), self.code.name("h")
            self.emit(f"{a}, {u} = {h1}.chunk(2, dim=-1)")
            self.emit(f"{h} = F.silu({a}) * {u}")
        elif gated == "interleaved":  # GPT-OSS: gate and up interleaved, the gate clamped
            a, u, h = self.code.name("g"), self.code.name("u"), self.code.name("h")
            self.emit(f"{a}, {u} = {h1}[..., ::2].clamp(max=7.0), {h1}[..., 1::2].clamp(-7.0, 7.0)")
            self.emit(f"{h} = ({u} + 1) * ({a} * torch.sigmoid({a} * 1.702))")
        else:
            h = self.act(h1)
        y = self.expert_gemm(h, E, F, H, sid, offs)
        if g.random() < 0.3:
            y = self.expert_bias(E, H, y, sid)
        out = self.code.name("mo")
        self.emit(f"{y} = {y} * {sw}.unsqueeze(-1)")
        if offs is None:
            self.emit(f"{out} = {y}.view(-1, {k}, {H}).sum(1).view({x}.shape)")
        elif g.random() < 0.5:
            inv = self.code.name("inv")
            self.emit(f"{inv} = torch.empty_like({perm})")
            self.emit(f"{inv}[{perm}] = torch.arange({perm}.numel())")
            self.emit(f"{out} = {y}[{inv}].view(-1, {k}, {H}).sum(1).view({x}.shape)")
        else:
            self.emit(f"{out} = torch.zeros_like({t}).index_add_(0, {perm} // {k}, {y}).view({x}.shape)")
        if m["shared"]:  # a shared expert: a dense MLP on every token, gated by a sigmoid in some (Qwen2-MoE)
            shared = self.gemm(self.act(self.gemm(x, H, F)), F, H)
            if g.random() < 0.5:
                gate = self.code.name("sg")
                self.emit(f"{gate} = torch.sigmoid({self.gemm(x, H, 1, bias=False)})")
                shared = f"{gate} * {shared}"
            self.emit(f"{out} = {out} + {shared}")
        return out
