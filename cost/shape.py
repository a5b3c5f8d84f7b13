"""The shape of a GPT-like Transformer: the handful of numbers the cost model needs.

Glossary (Narayanan et al. 2021, "PTD-P", arXiv 2104.04473):
  l  layers                      h  hidden size
  a  attention heads             s  sequence length
  V  vocabulary size             B  global batch, in sequences per iteration
  f  feed-forward hidden size (4h in GPT; every closed form in the paper assumes f = 4h)
  E  routed experts per layer (a mixture of experts; 0: dense), k experts per token, f_e each expert's hidden size
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A GPT-shaped workload: l layers of (attention + MLP), token and position embeddings, an LM head.

    `ffn_hidden=0` means the GPT default f = 4h. With `experts` E > 0 every layer's MLP is a mixture of E routed
    experts, each a gated MLP (gate, up and down: 3 h f_e weights, as Mixtral, Qwen3-MoE, GPT-OSS and DeepSeek-V3
    write them) of hidden size `expert_ffn` f_e (0: f), behind a router (h E), each token through `top_k` k of them.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int = 1
    ffn_hidden: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {value!r}")
        if not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 0:
            raise ValueError(f"ModelShape.ffn_hidden must be an int >= 0 (0 means 4*hidden), got {self.ffn_hidden!r}")
        if self.hidden % self.heads:
            nearby = sorted({d for d in range(1, self.hidden + 1) if self.hidden % d == 0},
                            key=lambda d: abs(d - self.heads))[:2]
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}; "
                             f"nearby valid head counts: {', '.join(map(str, sorted(nearby)))}")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        for name in ("experts", "top_k", "expert_ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelShape.{name} must be an int >= 0, got {value!r}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"ModelShape.top_k must be 1..experts={self.experts} for a mixture of experts, got "
                             f"{self.top_k}")
        if not self.experts and (self.top_k or self.expert_ffn):
            raise ValueError("ModelShape.top_k and expert_ffn describe experts: set experts too (or leave them 0)")
        if self.experts and self.expert_ffn == 0:
            object.__setattr__(self, "expert_ffn", self.ffn_hidden)

    @property
    def moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.experts > 0

    @property
    def head_dim(self) -> int:
        """h / a."""
        return self.hidden // self.heads

    def with_batch(self, batch: int) -> "ModelShape":
        """The same model at a different global batch B."""
        return dataclasses.replace(self, batch=batch)

    def describe(self) -> str:
        """One line: l, h, a, s, V, B."""
        ffn = "" if self.ffn_hidden == 4 * self.hidden or self.moe else f" f={self.ffn_hidden}"
        moe = f" E={self.experts} k={self.top_k} f_e={self.expert_ffn}" if self.moe else ""
        return (f"l={self.layers} h={self.hidden} a={self.heads} s={self.seq} V={self.vocab} "
                f"B={self.batch}{ffn}{moe}")
