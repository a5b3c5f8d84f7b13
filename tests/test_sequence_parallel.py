"""Sequence parallelism (Config(sequence_parallel=True); passes/sharding/sequence_analysis.py and
passes/tensor_parallel/sequence_parallel.py): the golden graph of a layer on a simulated rank, the plan's account,
the errors, and exactness on threaded ranks (forward, and every parameter after SGD steps) against the unmodified
model, for [b, s, h] and [s, b, h] models, GEMMs on flattened rows, QK-norm, encoder-decoders and token mixers."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from expecttest import TestCase
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar.api import build
from fxpar.passes.ir.meta import FXPAR_RANDOM, Comm, comm_kind
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests import models
from tests.golden import graph_text
from tests.harness import module_pool
from tests.threaded import on_tp_ranks

SP = fxpar.Config(sequence_parallel=True)
pool2 = module_pool(2)
TOL = 1e-5


def _gpt(layers=1, hidden=16, heads=2, seq=4, dropout=0.0):
    from gpt import factory

    torch.manual_seed(0)
    return factory(batch=2, seq=seq, layers=layers, hidden=hidden, heads=heads, vocab=32, dropout=dropout)


def test_golden_gpt_layer_on_sequence_blocks():
    """Rank 0 of t=2: the lookup reduce-scatters, every f is an all-gather joined with the GEMMs it feeds and every
    g a reduce-scatter of 2x2x16 (the tokens halved), the norms, residual adds and the bias after g run on 2x2x16,
    and the replicated weights read on blocks enter through seq_weights (their gradients all-reduced in one; here
    one per module: a single layer is no stack of layers)."""
    model, args = _gpt()
    config = fxpar.Config(sequence_parallel=True, fuse=False)
    gm = build(model, TPComm(rank=0, size=2), args, config=config).compiled.callables[0]
    TestCase().assertExpectedInline(graph_text(gm), """\
arange = arange.default(4)  # R 4
tp_vocab_embedding_0 = tp_vocab_embedding_seq_0(p_wte_weight, ids)  # S(1) 2x2x16  [vocab_embedding_seq]
embedding_1 = embedding.default(p_wpe_weight, arange)  # R 4x16
tp_scatter_0 = tp_scatter_0(embedding_1)  # S(0) 2x16  [scatter]
add = add.Tensor(tp_vocab_embedding_0, tp_scatter_0)  # S(1) 2x2x16
tp_seq_weights_0 = tp_seq_weights_0(p_h_0_ln_1_weight, p_h_0_ln_1_bias)  # (R, R)  [seq_weights]
getitem_3 = getitem(tp_seq_weights_0, 0)  # R 16
getitem_4 = getitem(tp_seq_weights_0, 1)  # R 16
layer_norm = layer_norm.default(add, [16], getitem_3, getitem_4, 1e-05, False)  # S(1) 2x2x16
tp_seq_gather_linear_0 = tp_seq_gather_linear_0(layer_norm)  # (S(2, 3x[16]x1))  [seq_gather_linear]
getitem_11 = getitem(tp_seq_gather_linear_0, 0)  # S(2, 3x[16]x1) 2x4x24
split = split_with_sizes.default(getitem_11, [8, 8, 8], 2)  # (S(2), S(2), S(2))
getitem = getitem(split, 0)  # S(2) 2x4x8
getitem_1 = getitem(split, 1)  # S(2) 2x4x8
getitem_2 = getitem(split, 2)  # S(2) 2x4x8
view = view.default(getitem, [2, 4, 1, 8])  # S(2) 2x4x1x8
transpose = transpose.int(view, 1, 2)  # S(1) 2x1x4x8
view_1 = view.default(getitem_1, [2, 4, 1, 8])  # S(2) 2x4x1x8
transpose_1 = transpose.int(view_1, 1, 2)  # S(1) 2x1x4x8
view_2 = view.default(getitem_2, [2, 4, 1, 8])  # S(2) 2x4x1x8
transpose_2 = transpose.int(view_2, 1, 2)  # S(1) 2x1x4x8
transpose_3 = transpose.int(transpose_1, -2, -1)  # S(1) 2x1x8x4
matmul = matmul.default(transpose, transpose_3)  # S(1) 2x1x4x4
mul = mul.Tensor(matmul, 0.35355339059327373)  # S(1) 2x1x4x4
alias = alias.default(b_h_0_attn_mask)  # R 1x1x4x4
eq = eq.Scalar(alias, 0)  # R 1x1x4x4
masked_fill = masked_fill.Scalar(mul, eq, -inf)  # S(1) 2x1x4x4
softmax = softmax.int(masked_fill, -1)  # S(1) 2x1x4x4
dropout = dropout.default(softmax, 0.0, True)  # S(1) 2x1x4x4
matmul_1 = matmul.default(dropout, transpose_2)  # S(1) 2x1x4x8
transpose_4 = transpose.int(matmul_1, 1, 2)  # S(2) 2x4x1x8
contiguous = contiguous.default(transpose_4)  # S(2) 2x4x1x8
view_3 = view.default(contiguous, [2, 4, 8])  # S(2) 2x4x8
linear_1 = linear.default(view_3, p_h_0_attn_c_proj_weight)  # P 2x4x16
tp_g_0 = tp_seq_reduce_scatter_0(linear_1)  # S(1) 2x2x16  [seq_reduce_scatter]
tp_seq_weights_1 = tp_seq_weights_1(p_h_0_attn_c_proj_bias)  # (R)  [seq_weights]
getitem_5 = getitem(tp_seq_weights_1, 0)  # R 16
add_tensor = add.Tensor(tp_g_0, getitem_5)  # S(1) 2x2x16
dropout_1 = dropout.default(add_tensor, 0.0, True)  # S(1) 2x2x16
add_1 = add.Tensor(add, dropout_1)  # S(1) 2x2x16
tp_seq_weights_2 = tp_seq_weights_2(p_h_0_ln_2_weight, p_h_0_ln_2_bias)  # (R, R)  [seq_weights]
getitem_6 = getitem(tp_seq_weights_2, 0)  # R 16
getitem_7 = getitem(tp_seq_weights_2, 1)  # R 16
layer_norm_1 = layer_norm.default(add_1, [16], getitem_6, getitem_7, 1e-05, False)  # S(1) 2x2x16
tp_seq_gather_linear_1 = tp_seq_gather_linear_1(layer_norm_1)  # (S(2))  [seq_gather_linear]
getitem_12 = getitem(tp_seq_gather_linear_1, 0)  # S(2) 2x4x32
gelu = gelu.default(getitem_12)  # S(2) 2x4x32
linear_3 = linear.default(gelu, p_h_0_mlp_c_proj_weight)  # P 2x4x16
tp_g_1 = tp_seq_reduce_scatter_1(linear_3)  # S(1) 2x2x16  [seq_reduce_scatter]
tp_seq_weights_3 = tp_seq_weights_3(p_h_0_mlp_c_proj_bias)  # (R)  [seq_weights]
getitem_8 = getitem(tp_seq_weights_3, 0)  # R 16
add_tensor_1 = add.Tensor(tp_g_1, getitem_8)  # S(1) 2x2x16
dropout_2 = dropout.default(add_tensor_1, 0.0, True)  # S(1) 2x2x16
add_2 = add.Tensor(add_1, dropout_2)  # S(1) 2x2x16
tp_seq_weights_4 = tp_seq_weights_4(p_ln_f_weight, p_ln_f_bias)  # (R, R)  [seq_weights]
getitem_9 = getitem(tp_seq_weights_4, 0)  # R 16
getitem_10 = getitem(tp_seq_weights_4, 1)  # R 16
layer_norm_2 = layer_norm.default(add_2, [16], getitem_9, getitem_10, 1e-05, False)  # S(1) 2x2x16
tp_seq_gather_linear_2 = tp_seq_gather_linear_2(layer_norm_2)  # (S(2))  [seq_gather_linear]
getitem_13 = getitem(tp_seq_gather_linear_2, 0)  # S(2) 2x4x16
tp_gather_0 = tp_gather_0(getitem_13)  # R 2x4x32  [gather]
""")


def test_the_plan_says_what_ran_on_blocks():
    model, args = _gpt(layers=2)
    pm = build(model, TPComm(rank=0, size=2), args, config=SP)
    text = str(pm.plan)
    assert "sequence parallelism: the sequence (the token dim of length 4) in t=2 blocks; 5 all-reduces -> " \
           "reduce-scatters, 5 f -> all-gathers" in text, text


def test_off_without_a_config_flag_or_at_t1():
    model, args = _gpt()
    for config, comm in ((fxpar.Config(), TPComm(0, 2)), (SP, TPComm(0, 1))):
        gm = build(copy.deepcopy(model), comm, args, config=config).compiled.callables[0]
        kinds = {comm_kind(n) for n in gm.graph.nodes}
        assert not kinds & {Comm.SEQ_GATHER, Comm.SEQ_REDUCE_SCATTER, Comm.VOCAB_EMBEDDING_SEQ}


def test_a_sequence_t_does_not_divide_is_a_clear_error():
    model, args = _gpt(seq=5)
    with pytest.raises(ValueError, match=r"splits the sequence \(length 5.* not divisible by 2\. Fix: pad the "
                                         r"sequence to a multiple of 2, or set Config\(sequence_parallel=False\)"):
        build(model, TPComm(rank=0, size=2), args, config=SP)


class _NoAttention(torch.nn.Module):
    """MLP blocks only: no op mixes tokens, so no dim of the stream is provably the sequence."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32),
                                                              torch.nn.GELU(), torch.nn.Linear(32, 16))
                                          for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def test_without_attention_there_is_no_sequence_and_the_plan_says_so():
    pm = build(_NoAttention(), TPComm(rank=0, size=2), (torch.randn(2, 8, 16),), config=SP)
    assert "sequence parallelism: off (no attention mixes tokens along a dim of the residual stream" in str(pm.plan)


class _CumulativeMix(torch.nn.Module):
    """A GPT whose residual stream is averaged over the positions so far between its two layers (a token mixer
    outside every region)."""

    def __init__(self):
        super().__init__()
        self.gpt, self.args = _gpt(layers=2, seq=8)

    def forward(self, ids):
        g = self.gpt
        x = g.wte(ids) + g.wpe(torch.arange(ids.shape[1]))
        x = g.h[0](x)
        x = x.cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return g.lm_head(g.ln_f(g.h[1](x)))


def _gaps(pm, reference, args, kwargs, steps=3):
    """Forward gap (relative to the output's scale), and the largest parameter gap (absolute) after SGD steps, whose
    step is lr times the gradient: every gradient at fp32's rounding. Not AdamW: its first step, lr * g / (|g| + eps),
    has slope lr / eps at g = 0, and a key projection's bias has an exactly-zero gradient (softmax ignores a score
    added to every key), so its step is rounding's: 1e-5 at lr 1e-3 on an AVX2 CPU (Llama with GQA at t=4), 7e-4
    for torch's fused in_proj, with or without sequence parallelism."""
    out, want = models.first_tensor(pm(*args, **kwargs)), models.first_tensor(reference(*args, **kwargs))
    fwd = ((out - want).abs().max() / want.abs().max()).item()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (pm, reference)]
    for _ in range(steps):
        for m, opt in zip((pm, reference), opts):
            opt.zero_grad()
            y = models.first_tensor(m(*args, **kwargs))
            torch.nn.functional.cross_entropy(y.flatten(0, -2), _targets(y)).backward() if y.dim() > 2 \
                else y.square().mean().backward()
            opt.step()
    full, ref = pm.full_state_dict(), reference.state_dict()
    return fwd, max((full[k] - ref[k]).abs().max().item() for k in ref)


def _targets(y):
    return torch.arange(y.shape[:-1].numel()) % y.shape[-1]


def _exact(model, args, kwargs, tp=2, **options):
    config = fxpar.Config(sequence_parallel=True, **options)
    results = on_tp_ranks(model, args, lambda pm, ref: (_gaps(pm, ref, args, kwargs), str(pm.plan)),
                          kwargs=kwargs, tp=tp, config=config, timeout_s=180.0)
    for (fwd, params), plan in results:
        assert "sequence parallelism: the sequence (the token dim of length 8) in" in plan, plan
        assert fwd < TOL and params < TOL, (fwd, params)
    return results[0][1]


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama_gqa", "qwen3", "bert", "t5", "encoder_pre_ln",
                                  "encoder_seq_first"])
def test_exact_at_t2(name):
    """[b, s, h] and [s, b, h], Conv1D GEMMs on flattened rows (GPT-2), grouped K/V, QK-norm, BERT's pooler, an
    encoder-decoder: forward (relative) and every parameter after 3 SGD steps within 1e-5."""
    model, args, kwargs = models.build(name)
    _exact(model, args, kwargs)


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama", "llama_gqa", "qwen3", "bert", "t5"])
def test_exact_at_t4(name):
    model, args, kwargs = models.build(name)
    _exact(model, args, kwargs, tp=4)


def test_a_token_mixer_between_regions_is_gathered_before_and_named():
    model = _CumulativeMix()
    plan = _exact(model, model.args, {})
    assert "gathered before cumsum (module <root>): cumsum: cumsum.default along the sharded dim 1" in plan


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_exact_with_recompute(recompute):
    model, args, kwargs = models.build("gpt")
    _exact(model, args, kwargs, recompute=recompute)


def test_dropout_on_a_sequence_block_draws_from_the_ranks_own_stream():
    model, args = _gpt(layers=1, dropout=0.1)
    model.train()
    gm = build(model, TPComm(rank=0, size=2), args, config=SP).compiled.callables[0]
    streams = {n.args[0].name if n.args else n.name: n.meta[FXPAR_RANDOM] for n in gm.graph.nodes
               if FXPAR_RANDOM in n.meta}
    assert streams and set(streams.values()) == {"sharded"}, streams


class _Collectives(TorchDispatchMode):
    """The c10d collectives that reach the dispatcher: (op, whether it moves an activation (at least a sequence
    block's elements) or weights' gradients)."""

    def __init__(self, block: int):
        super().__init__()
        self.block, self.counts = block, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                       if isinstance(t, torch.Tensor)]
            size = max((t.numel() for t in tensors), default=0)
            kind = "activation" if size >= self.block else "weight"
            self.counts[(func.__name__.split(".")[0].rstrip("_"), kind)] += 1
        return func(*args, **(kwargs or {}))


def _collectives(layers: int):
    """On a gloo rank of t=2 (the threaded process group does not dispatch its collectives)."""
    model, args = _gpt(layers=layers, hidden=32, heads=4, seq=8)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, config=SP)
    block = args[0].numel() * 32 // 2  # b * s * h / t
    with _Collectives(block) as fwd:
        y = pm(*args)
    with _Collectives(block) as bwd:
        y.float().square().mean().backward()
    ledger = next(c for c in pm.plan.comm if c.layer == "h.0")  # what the plan and `fxpar check` say it runs
    return fwd.counts, bwd.counts, [collections.Counter(x.op for x in half) for half in (ledger.forward,
                                                                                         ledger.backward)]


def test_collectives_per_layer_at_the_dispatcher(pool2):
    """Per layer (4 layers less 2, halved): 2 all-gathers and 2 reduce-scatters of activations forward, the mirror
    in backward plus the 2 all-gathers that bring back the regions' inputs (saved as blocks, as Megatron does), no
    all-reduce of an activation; the weights read on sequence blocks (2 norms' weight and bias, 2 biases after g)
    all-reduce their gradients in one. The plan's ledger lists the same collectives under the same passes."""
    (f2, b2, ledger), (f4, b4, _) = pool2.run(_collectives, 2)[0], pool2.run(_collectives, 4)[0]
    per_layer = {"forward": {k: (f4[k] - f2[k]) / 2 for k in f4 | f2}, "backward": {k: (b4[k] - b2[k]) / 2
                                                                                    for k in b4 | b2}}
    assert {k: v for k, v in per_layer["forward"].items() if v} == {
        ("allgather", "activation"): 2, ("reduce_scatter", "activation"): 2}, per_layer
    assert {k: v for k, v in per_layer["backward"].items() if v} == {
        ("allgather", "activation"): 4, ("reduce_scatter", "activation"): 2, ("allreduce", "weight"): 1}, per_layer
    assert ledger == [{"all-gather": 2, "reduce-scatter": 2},
                      {"all-gather again": 2, "reduce-scatter": 2, "all-gather": 2}], ledger


def _saved_bytes(pm, _, args):
    from fxpar.runtime.measure import saved_activation_bytes

    weights = [*pm.parameters(), *pm.buffers()]
    return saved_activation_bytes(lambda: pm(*args), exclude=weights)[1]


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_layer_saves_fewer_bytes(recompute):
    """Saved activation bytes per layer (4 layers less 2, halved) at t=2: with sequence parallelism the norms,
    residual adds and dropout masks between the regions keep 1/t of the tokens."""
    def per_layer(sp):
        out = []
        for layers in (2, 4):
            model, args = _gpt(layers=layers, hidden=32, heads=4, seq=16, dropout=0.1)
            config = fxpar.Config(sequence_parallel=sp, recompute=recompute)
            out.append(on_tp_ranks(model, args, lambda pm, ref: _saved_bytes(pm, ref, args), config=config)[0])
        return (out[1] - out[0]) / 2

    without, with_sp = per_layer(False), per_layer(True)
    assert with_sp < without, (with_sp, without)


pool4 = module_pool(4, timeout_s=120.0)


def test_composes_with_interleaved_pipelines_and_sends_blocks(pool4):
    """(p, t) = (2, 2), two chunks per rank, interleaved 1F1B: exact after 3 steps, and every boundary message is a
    sequence block (1/t of the activation, with no all-gather on arrival)."""
    from tests.test_pipeline_exact import _train

    for loss_gap, state_gap, _, sent, _ in pool4.run(_train, "gpt8", 2, 2, 1, 2, "interleaved-1f1b", 4,
                                                     scatter_gather=False, sequence_parallel=True):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)
        assert set(sent.values()) == {models.BATCH * models.SEQ * 32 * 4 // 2}, sent  # fp32 [b, s/t, h]


def test_replicas_stay_identical_with_the_distributed_optimizer(pool4):
    """t=2 x d=2 with ZeRO-1, 20 AdamW steps in float64 (tests/test_zero.py says why): exact, and check_replicas()
    finds every norm weight and bias (read on sequence blocks, their gradients all-reduced) equal on both tp ranks
    (Megatron-LM #1446's class)."""
    from tests.test_zero import _adamw

    for loss_gap, state_gap, _, _ in pool4.run(_adamw, "llama", 1, 2, 2, 1, 20, None, False,
                                               sequence_parallel=True, check_replicas_every=1):
        assert loss_gap <= models.FLOAT64_TOL and state_gap <= models.FLOAT64_TOL, (loss_gap, state_gap)


def test_bf16_matches_the_recipe(pool2):
    from tests.test_mixed_precision import BAND, REL, _train

    for gap, band, _, mains, params in pool2.run(_train, "gpt", 1, 2, 1, fp32_too=True, sequence_parallel=True):
        assert gap < REL and band < BAND, (gap, band)
        assert mains == ["torch.float32"] and params == ["torch.bfloat16"], (mains, params)


def test_weights_are_sharded_as_without_it():
    """Sequence parallelism moves activations only: every weight has the placement it has without it, so a
    checkpoint (fxpar.save: each weight's shards by its placement) loads with it or without it."""
    model, args = _gpt(layers=2)
    specs = [build(copy.deepcopy(model), TPComm(rank=0, size=2), args,
                   config=fxpar.Config(sequence_parallel=on)).compiled.specs for on in (False, True)]
    assert specs[0] == specs[1] and specs[0]


def test_two_sequences_of_different_lengths_leave_it_off_and_say_why():
    """T5 with a decoder shorter than its encoder: one probe cannot name a sequence in both; off, with the lengths."""
    model, args, kwargs = models.build("t5")
    kwargs = dict(kwargs, decoder_input_ids=kwargs["decoder_input_ids"][:, :4])
    pm = build(model, TPComm(rank=0, size=2), args, kwargs, config=SP)
    assert "sequence parallelism: off (the regions' outputs have token dims [(2, 4), (2, 8)]" in str(pm.plan)


class _EndsAtG(torch.nn.Module):
    """A layer whose row-parallel GEMM's output is the model's output: the reduce-scattered block itself is gathered
    before it is returned."""

    def __init__(self):
        super().__init__()
        self.gpt, self.args = _gpt(layers=1, seq=8)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16, bias=False)  # g is the output

    def forward(self, ids):
        h = self.gpt.h[0](self.gpt.wte(ids))
        return self.down(torch.nn.functional.gelu(self.up(h)))


def test_a_block_read_whole_straight_from_its_reduce_scatter_is_gathered():
    model = _EndsAtG()
    plan = _exact(model, model.args, {})
    assert "gathered before output (module <root>): the model's outputs are whole" in plan, plan


class _WritesBetweenLayers(torch.nn.Module):
    """`y[:, 0] = 0` between the layers: an in-place write into the residual stream (select + fill_ in the trace)."""

    def __init__(self):
        super().__init__()
        self.gpt, self.args = _gpt(layers=2, seq=8)

    def forward(self, ids):
        g = self.gpt
        y = g.h[0](g.wte(ids)) * 1.0
        y[:, 0] = 0.0
        return g.lm_head(g.ln_f(g.h[1](y)))


def test_an_in_place_write_between_regions_leaves_it_off_and_names_the_op():
    torch.manual_seed(0)
    model = _WritesBetweenLayers()
    results = on_tp_ranks(model, model.args, lambda pm, ref: ((pm(*model.args) - ref(*model.args)).abs().max().item(),
                                                              str(pm.plan)), config=SP)
    for gap, plan in results:
        assert gap <= TOL, gap
        assert "sequence parallelism: off (fill_" in plan, plan
        assert "writes in place into a value between the regions" in plan, plan


def test_gemms_on_flattened_rows_save_blocks_too():
    """GPT-2's Conv1D (`addmm(b, x.view(-1, h), w)` with w [in, out]): each layer's all-gathers are joined with their
    GEMMs, the 2-D view inside, so no layer saves a whole gathered sequence. The one before the LM head reaches its
    GEMM through a 3-D view and an alias, and stays a plain all-gather."""
    model, args, kwargs = models.build("gpt2")
    gm = build(model, TPComm(rank=0, size=2), args, kwargs, config=SP).compiled.callables[0]
    kinds = collections.Counter(comm_kind(n) for n in gm.graph.nodes)
    assert kinds[Comm.SEQ_GATHER_LINEAR] == 4 and kinds[Comm.SEQ_GATHER] == 1, kinds
