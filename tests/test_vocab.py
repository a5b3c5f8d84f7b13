"""passes/sharding/vocab_analysis.py: the token embedding is found by structure (its ids are a model input), not by
size."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.models import sgd_gaps
from tests.threaded import on_tp_ranks

V, P, H = 32, 48, 8  # more positions than tokens, as BART's and BioGPT's offset positional tables have


class LearnedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(V, H), nn.Embedding(P, H)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device) + 2  # computed ids: not the vocabulary
        h = self.tokens(ids) + self.positions(pos)
        return self.head(h + self.mlp(h))


def test_the_token_embedding_is_the_lookup_of_the_input_ids_not_the_largest_table():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 5))

    def measure(pm, reference):
        vocab = [g for reg in pm.plan.regions if reg.kind == "vocab" for g in reg.columns + reg.rows]
        return (*sgd_gaps(pm, reference, (ids,)), vocab, {k: tuple(v.shape) for k, v in pm.state_dict().items()})

    for fwd, params, vocab, shapes in on_tp_ranks(LearnedPositions(), (ids,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert len(vocab) == 2, vocab  # the token lookup and the head
        assert shapes["tokens.weight"] == (V // 2, H) and shapes["head.weight"] == (V // 2, H), shapes
        assert shapes["positions.weight"] == (P, H), shapes  # the positional table stays whole


class OddTable(nn.Module):
    """A table of V + 1 rows (the vocabulary and one more id, as moshi's) and an untied head of V rows; with
    `wide=False` the head is narrower than its input (a classifier, not an LM head)."""

    def __init__(self, wide: bool = True):
        super().__init__()
        self.tokens = nn.Embedding(V + 1, H)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.head = nn.Linear(H, V if wide else H // 2)

    def forward(self, ids):
        h = self.tokens(ids)
        return self.head(h + self.mlp(h))


def test_an_untied_head_is_split_over_its_own_rows_when_t_does_not_divide_the_table():
    torch.manual_seed(0)
    ids = torch.randint(0, V + 1, (2, 5))

    def measure(pm, reference):
        reasons = [r.reason for r in pm.plan.regions if r.kind == "vocab"]
        return (*sgd_gaps(pm, reference, (ids,)), reasons, {k: tuple(v.shape) for k, v in pm.state_dict().items()})

    for fwd, params, reasons, shapes in on_tp_ranks(OddTable(), (ids,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert shapes["tokens.weight"] == (V + 1, H) and "not divisible by t=2" in reasons[0], (shapes, reasons)
        assert shapes["head.weight"] == (V // 2, H) and shapes["head.bias"] == (V // 2,), shapes


def test_a_head_narrower_than_its_input_is_not_taken_for_the_lm_head():
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm

    torch.manual_seed(0)
    plan = build(OddTable(wide=False), TPComm(rank=0, size=2), (torch.randint(0, V + 1, (2, 5)),)).plan
    assert {w.key: w.local_shape for w in plan.weights}["head.weight"] == (H // 2, H), plan.region_table()
