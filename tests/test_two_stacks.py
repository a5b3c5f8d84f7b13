"""Two stacks (encoder + decoder): T5, BART and torch's nn.Transformer are cut into pipeline chunks across both
stacks, balanced, and train exactly at p=2 (also v=2: four chunks), p=4 and t=2, with the local share asserted."""
from __future__ import annotations

import copy

import pytest
import torch

from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
pool4 = module_pool(4)
TOL = 1e-5
ROWS = 2 * models.BATCH  # two microbatches


def _ids(seed):
    return torch.randint(0, models.VOCAB, (ROWS, models.SEQ), generator=torch.Generator().manual_seed(seed))


def _t5():
    model = models._hf("T5Config", "T5ForConditionalGeneration", d_model=32, d_ff=64, d_kv=8, num_layers=2,
                       num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                       vocab_size=models.VOCAB)
    return model, (_ids(1),), {"decoder_input_ids": _ids(2), "use_cache": False}


def _bart():
    model = models._hf("BartConfig", "BartForConditionalGeneration", d_model=32, encoder_ffn_dim=64,
                       decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, vocab_size=models.VOCAB)
    return model, (_ids(1),), {"decoder_input_ids": _ids(2), "use_cache": False}


def _transformer():
    model = torch.nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(ROWS, models.SEQ, 32, generator=g), torch.randn(ROWS, models.SEQ, 32, generator=g)), {}


BUILD = {"t5": _t5, "bart": _bart, "transformer": _transformer}
STACKS = {"t5": "encoder.block, decoder.block", "bart": "model.encoder.layers, model.decoder.layers",
          "transformer": "encoder.layers, decoder.layers"}


def _loss(out, target):
    return models.first_tensor(out).sin().mean()


def _one_microbatch(x):
    return x[: models.BATCH] if isinstance(x, torch.Tensor) else x


def _train(name, p, t, v):
    """(loss gap, parameter gap after 2 SGD steps, each chunk's layers by module path, local share)."""
    import fxpar

    torch.manual_seed(0)
    model, args, kwargs = BUILD[name]()
    model.train()
    reference = copy.deepcopy(model)
    example = [_one_microbatch(a) for a in args], {k: _one_microbatch(x) for k, x in kwargs.items()}
    config = fxpar.Config(microbatches=2, virtual_stages=v, schedule="interleaved-1f1b" if v > 1 else "1f1b")
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p), example_args=tuple(example[0]),
                           example_kwargs=example[1], loss_fn=_loss, config=config)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    gap = 0.0
    for _ in range(2):
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pm.step(*args, target=torch.zeros(ROWS), **kwargs)
        ref_loss = _loss(reference(*args, **kwargs), None)
        ref_loss.backward()
        opt.step(), ref_opt.step()
        gap = max(gap, abs(loss.item() - ref_loss.item()))
    full, want = pm.full_state_dict(), reference.state_dict()
    state_gap = max((full[k] - want[k]).abs().max().item() for k in want)
    part = pm.compiled.partition
    chunks = [[part.entries[i] for i in c.layers] for c in part.chunks]
    local = sum(p.numel() for p in pm.parameters())
    return gap, state_gap, chunks, part.block, local / sum(p.numel() for p in reference.parameters())


def _check(results, name):
    for gap, state_gap, _, block, _ in results:
        assert gap <= TOL and state_gap <= TOL, (gap, state_gap)
        assert block == STACKS[name]


@pytest.mark.parametrize("name", ["t5", "bart", "transformer"])
def test_both_stacks_are_cut_at_p2(pool2, name):
    results = pool2.run(_train, name, 2, 1, 1)
    _check(results, name)
    chunks = results[0][2]
    assert [len(c) for c in chunks] == [2, 2]  # the encoder on one stage, the decoder on the other
    assert all(".encoder." in f".{e}" for e in chunks[0]) and all(".decoder." in f".{e}" for e in chunks[1])


@pytest.mark.parametrize("name", ["t5", "transformer"])
def test_four_chunks_over_two_stacks_interleaved(pool2, name):
    results = pool2.run(_train, name, 2, 1, 2)
    _check(results, name)
    assert [len(c) for c in results[0][2]] == [1, 1, 1, 1]


def test_four_stages(pool4):
    _check(pool4.run(_train, "t5", 4, 1, 1), "t5")


# nn.Transformer: the decoder's cross-attention (torch's packed in_proj split into a query and a key-value GEMM)
# stays replicated, a known limit the plan states; its self-attention and MLP blocks are sharded.
@pytest.mark.parametrize("name,share", [("t5", 0.56), ("bart", 0.55), ("transformer", 0.62)])
def test_both_stacks_are_sharded_at_t2(pool2, name, share):
    results = pool2.run(_train, name, 1, 2, 1)
    _check(results, name)
    for *_, local in results:
        assert local <= share, local


def test_cross_attention_is_one_region_with_two_inputs():
    """[Note: regions with two inputs] BART's decoder cross-attention: queries from the decoder, keys and values
    from the encoder's output (one seed group over both layers): each layer's q, k and v are column-parallel."""
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.rewrite import TPComm

    torch.manual_seed(0)
    model, args, kwargs = _bart()
    pm = build(model, TPComm(0, 2), tuple(map(_one_microbatch, args)),
               {k: _one_microbatch(x) for k, x in kwargs.items()})
    cross = [r for r in pm.plan.regions if r.module.endswith("encoder_attn")]
    assert len(cross) == 2 and not any(r.replicated for r in pm.plan.regions)
    for r in cross:
        assert sorted(r.modules[c].rsplit(".", 1)[1] for c in r.columns) == ["k_proj", "q_proj", "v_proj"]
        assert [r.modules[g].rsplit(".", 1)[1] for g in r.rows] == ["out_proj"]


def test_the_layer_sequence_runs_both_stacks_in_order():
    from fxpar.passes.frontend.layers import find_layers
    from fxpar.trace import trace

    model, args, kwargs = _t5()
    layers = find_layers(trace(model, tuple(map(_one_microbatch, args)),
                               {k: _one_microbatch(x) for k, x in kwargs.items()}).gm)
    assert layers.sequence == ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    assert layers.main.path in ("encoder.block", "decoder.block")
