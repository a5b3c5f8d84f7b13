"""Dropout at t=2 with Megatron's random streams ([Note: random streams] in passes/rng.py): masks drawn in
replicated parts are the same on every tp rank, masks inside sharded regions differ, the rate is p, and none of it
depends on the users' per-rank seeds."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from tests import models  # noqa: F401 - puts examples/ (the example GPT) on sys.path, here and on the ranks
from tests.harness import module_pool

pool2 = module_pool(2)
P = 0.1


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps, for every random op on a stream, (stream, its input, its output)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.draws = []

    def run_node(self, n):
        from fxpar.passes.meta import FXPAR_RANDOM

        out = super().run_node(n)
        if FXPAR_RANDOM in n.meta:
            self.draws.append((n.meta[FXPAR_RANDOM], self.env[n.args[0]], out))
        return out


def _dropout_draws(per_rank_seed: bool):
    import torch.distributed as dist

    import fxpar
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, layers=2, hidden=64, heads=4, dropout=P)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(1))
    if per_rank_seed:
        torch.manual_seed(1000 + dist.get_rank())  # users often seed each rank differently
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=(ids,), config=fxpar.Config(fuse=False))
    rec = _Recorder(pm.graph_module)
    logits = rec.run(*pm.graph_inputs([ids]))[0]
    out = {"logits_gap": _gap_across_ranks(logits)}
    for stream in ("replicated", "sharded"):
        kept = [(x != 0, y != 0) for s, x, y in rec.draws if s == stream]
        masks = torch.cat([k[live] for live, k in kept])  # positions whose input was not already 0
        out[f"{stream}_rate"] = 1 - masks.float().mean().item()
        out[f"{stream}_same_on_both_ranks"] = _gap_across_ranks(masks.float()) == 0
    return out


def _gap_across_ranks(x: torch.Tensor) -> float:
    import torch.distributed as dist

    both = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(both, x.contiguous())
    return (both[0] - both[1]).abs().max().item()


@pytest.mark.parametrize("per_rank_seed", [False, True])
def test_replicated_masks_agree_and_sharded_masks_differ(pool2, per_rank_seed):
    for out in pool2.run(_dropout_draws, per_rank_seed):
        assert out["logits_gap"] == 0, out  # replicated activations are identical on every tp rank
        assert out["replicated_same_on_both_ranks"], out  # the residual-stream dropout draws one mask
        assert not out["sharded_same_on_both_ranks"], out  # each rank drops its own heads' positions
        assert abs(out["replicated_rate"] - P) < 0.01 and abs(out["sharded_rate"] - P) < 0.01, out


def _reseeded_steps_repeat():
    """pm.manual_seed restarts the streams: the same seed gives the same masks, step after step."""
    import fxpar
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, dropout=P)
    ids = torch.randint(0, cfg.vocab, (2, cfg.seq))
    pm = fxpar.parallelize(GPT(cfg), fxpar.init_mesh(tp=2), example_args=(ids,))
    pm.manual_seed(7)
    a = pm(ids)
    b = pm(ids)
    pm.manual_seed(7)
    return (pm(ids) - a).abs().max().item(), (b - a).abs().max().item()


def test_manual_seed_makes_dropout_reproducible(pool2):
    for same, different in pool2.run(_reseeded_steps_repeat):
        assert same == 0 and different > 0
