"""Dropout at t=2 with Megatron's random streams ([Note: random streams] in passes/tensor_parallel/rng.py): masks drawn
in replicated parts are the same on every tp rank, masks inside sharded regions differ, the rate is p, and none of it
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
        from fxpar.passes.ir.meta import FXPAR_RANDOM

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
    rec = _Recorder(pm.compiled.callables[0])
    logits = rec.run(*pm._graph_inputs([ids]))[0]
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


class _DropMLP(torch.nn.Module):
    """Dropout on the replicated input and inside the sharded hidden layer (passes/tensor_parallel/rng.py)."""

    def __init__(self, h: int = 8):
        super().__init__()
        self.up, self.down = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        x = torch.nn.functional.dropout(x, 0.1, self.training)
        return x + self.down(torch.nn.functional.dropout(torch.relu(self.up(x)), 0.2, self.training))


def test_golden_each_random_op_draws_from_its_placements_stream():
    """passes/tensor_parallel/rng.py on rank 0 of t=2: the dropout of a replicated value draws from the tp group's
    shared stream, the one inside the column-parallel region from this rank's own."""
    from expecttest import TestCase

    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm
    from tests.golden import graph_text

    gm = build(_DropMLP(), TPComm(rank=0, size=2), (torch.randn(2, 3, 8),)).compiled.callables[0]
    TestCase().assertExpectedInline(graph_text(gm), """\
rng_0 = rng_0(x, 0.1, True)  # R 2x3x8  [stream replicated]
tp_f_0 = tp_f_0(rng_0)  # R 2x3x8  [f in place]
linear = linear.default(tp_f_0, p_up_weight, p_up_bias)  # S(2) 2x3x16
relu = relu.default(linear)  # S(2) 2x3x16
rng_1 = rng_1(relu, 0.2, True)  # S(2) 2x3x16  [stream sharded]
linear_1 = linear.default(rng_1, p_down_weight)  # P 2x3x8
tp_g_0 = tp_g_0(linear_1)  # R 2x3x8  [g in place]
add_tensor = add.Tensor(tp_g_0, p_down_bias)  # R 2x3x8
add = add.Tensor(rng_0, add_tensor)  # R 2x3x8
""")
