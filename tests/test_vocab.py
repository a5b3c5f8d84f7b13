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
