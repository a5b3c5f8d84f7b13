"""Tiny models built from configs in code (nothing is downloaded): name -> (model, example_args, example_kwargs)."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

VOCAB, BATCH, SEQ = 64, 2, 8
# A float64 run against its float64 reference, after AdamW steps: AdamW's slope lr / eps at a zero gradient turns
# the last bit of a summation order into 1e-5 of a weight in fp32 (another CPU, another bit), but float64's rounding
# is 2^29 times smaller (measured gaps: 1e-13 and below); a wrong rewrite is off by far more.
FLOAT64_TOL = 1e-10


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _hf(config_cls, model_cls, **cfg):
    import transformers

    transformers.logging.set_verbosity_error()
    config = getattr(transformers, config_cls)(**cfg)
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "sdpa"
    return getattr(transformers, model_cls)(config)


def _causal(model):
    return model, (_ids(),), {"use_cache": False}


HF_COMMON = dict(vocab_size=VOCAB)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, **HF_COMMON)

BUILDERS = {
    "gpt": lambda: _gpt(),
    "encoder_pre_ln": lambda: _encoder(True),
    "encoder_post_ln": lambda: _encoder(False),
    "encoder_seq_first": lambda: _encoder(True, batch_first=False),  # activations [s, b, h]
    "gpt2": lambda: _causal(_hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=4, n_positions=32,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **HF_COMMON)),
    "starcoder_mqa": lambda: _causal(_hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_layer=2, n_embd=32, n_head=4,
                                         n_positions=32, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, **HF_COMMON)),  # one K/V head in a fused [q | k | v]
    "llama": lambda: _causal(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=4, **LLAMA_LIKE)),
    "llama_gqa": lambda: _causal(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **LLAMA_LIKE)),
    "llama_mqa": lambda: _causal(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1, **LLAMA_LIKE)),
    "qwen2": lambda: _causal(_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **LLAMA_LIKE)),
    "qwen3": lambda: _causal(_hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8,
                                 **LLAMA_LIKE)),  # QK-norm: an RMSNorm over each head's features
    "t5": lambda: _t5(),
    "mistral": lambda: _causal(_hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, **LLAMA_LIKE)),
    "phi3": lambda: _causal(_hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4, pad_token_id=0,
                                **LLAMA_LIKE)),
    "gpt_neox": lambda: _causal(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                                    use_parallel_residual=True, **HF_COMMON)),
    "gptj": lambda: _causal(_hf("GPTJConfig", "GPTJForCausalLM", n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **HF_COMMON)),
    "bert": lambda: _bert(),
    # architectures whose parts once came out silently wrong (tests/test_soundness.py)
    "recurrent_gemma": lambda: _causal(_hf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", num_hidden_layers=3,
                                           hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                           num_key_value_heads=1, lru_width=32, attention_window_size=16,
                                           conv1d_width=4, block_types=["recurrent", "recurrent", "attention"],
                                           **HF_COMMON)),
    "gemma4_unified_text": lambda: _causal(_hf("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
                                               num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               max_position_embeddings=64, sliding_window=4, **HF_COMMON)),
    # deeper ones, for pipeline stages
    "gpt5": lambda: _gpt(layers=5),
    "gpt8": lambda: _gpt(layers=8),
    "llama8": lambda: _causal(_hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2,
                                  **(LLAMA_LIKE | {"num_hidden_layers": 8}))),
}


def _gpt(layers: int = 2):
    from gpt import factory

    model, args = factory(batch=BATCH, seq=SEQ, layers=layers, hidden=32, heads=4, vocab=VOCAB)
    return model, args, {}


def _encoder(norm_first: bool, batch_first: bool = True):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    shape = (BATCH, SEQ, 32) if batch_first else (SEQ, BATCH, 32)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return model, (x,), {}


def _t5():
    model = _hf("T5Config", "T5ForConditionalGeneration", d_model=32, d_ff=64, d_kv=8, num_layers=2,
                num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                **HF_COMMON)
    g = torch.Generator().manual_seed(2)
    return model, (_ids(),), {"decoder_input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                              "use_cache": False}


def _bert():
    model = _hf("BertConfig", "BertModel", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, **HF_COMMON)
    return model, (_ids(),), {}


def build(name: str):
    """A fresh model with deterministic weights, its example args and kwargs."""
    torch.manual_seed(0)
    model, args, kwargs = BUILDERS[name]()
    model.train()
    return model, args, kwargs


def first_tensor(out) -> torch.Tensor:
    """The main output tensor of any of these models (logits, last hidden state, or the tensor itself)."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        if hasattr(out, key):
            return getattr(out, key)
    return out[0]


def sgd_gaps(pm, reference, args, kwargs=None, lr: float = 0.5) -> tuple[float, float]:
    """Max |difference| of the forward output and of every parameter after one SGD step (loss: mean of sin).
    pm is a ParallelModule (compared through its full_state_dict) or a plain module (another precision of the
    reference, to measure a model's own rounding)."""
    kwargs = kwargs or {}
    out, ref = first_tensor(pm(*args, **kwargs)), first_tensor(reference(*args, **kwargs))
    fwd = (out.double() - ref.double()).abs().max().item()
    for m, y in ((pm, out), (reference, ref)):
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        (y.to(torch.promote_types(y.dtype, torch.float32)).sin().sum() / y.numel()).backward()
        opt.step()
    full, want = getattr(pm, "full_state_dict", pm.state_dict)(), reference.state_dict()
    return fwd, max((full[k].double() - want[k].double()).abs().max().item() for k in want)


def step_gaps(pm, reference, x, target, loss_fn, steps: int = 2, lr: float = 0.5, around=None):
    """Train `steps` SGD steps of pm.step(x, target=target) beside the single-process reference on the whole batch:
    (the largest loss difference, the largest parameter difference after the last step). around(step): a context
    manager each pm.step runs inside (to count what it does), or None."""
    import contextlib

    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=lr), torch.optim.SGD(reference.parameters(), lr=lr)
    loss_gap = 0.0
    for step in range(steps):
        opt.zero_grad(), ref_opt.zero_grad()
        with around(step) if around else contextlib.nullcontext():
            loss = pm.step(x, target=target)
        ref_loss = loss_fn(reference(x), target)
        ref_loss.backward()
        opt.step(), ref_opt.step()
        loss_gap = max(loss_gap, abs(loss.item() - ref_loss.item()))
    full, want = pm.full_state_dict(), reference.state_dict()
    return loss_gap, max((full[k].double() - want[k].double()).abs().max().item() for k in want)


def gaps_and_share(args, kwargs=None):
    """A per-rank measure for on_tp_ranks: (forward gap, parameter gap after SGD, the rank's local share of the
    parameters)."""
    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, args, kwargs), share)

    return measure


class Stack(torch.nn.Module):
    """`n` layers made by `layer()` in a ModuleList, run in order: the smallest model with a layer list."""

    def __init__(self, layer, n: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@contextlib.contextmanager
def float64_stays():
    """Hugging Face's loss upcasts the logits with `.float()`, which would make it fp32 on a float64 model: here
    `.float()` keeps float64 tensors as they are (as `fxpar check`'s float64 arbiter does)."""
    upcast = torch.Tensor.float
    torch.Tensor.float = lambda x, **kw: x if x.dtype == torch.float64 else upcast(x, **kw)
    try:
        yield
    finally:
        torch.Tensor.float = upcast
