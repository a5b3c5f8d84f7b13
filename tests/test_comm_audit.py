"""The plan's communication per layer (passes/sharding/comm_audit.py) against Megatron's 2 + 2 (with sequence
parallelism 4 + 6, each collective under the pass that runs it), and low-rank pairs kept
to Megatron's layout ([Note: low-rank pairs] in passes/sharding/analysis.py): golden plans on simulated ranks, numerics
on threaded gloo ranks."""
from collections import Counter

import pytest
import torch
import torch.nn as nn

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests import models
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

H = 16


class MLP(nn.Module):
    def __init__(self, inner=4 * H):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, inner), nn.Linear(inner, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ThreeMLPs(nn.Module):
    """Each layer three residual MLPs: three regions, above Megatron's two."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = MLP(), MLP(), MLP()

    def forward(self, x):
        return self.third(self.second(self.first(x)))


class SmallInner(nn.Module):
    """An MLP narrower inside than outside (most MoE experts): h -> h/2 -> h, a plain region, not a low-rank pair."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(inner=H // 2)

    def forward(self, x):
        return self.mlp(x)


class LowRank(nn.Module):
    """A low-rank factored up-projection (MLA's query, a low-rank gate): h -> r -> 4h -> h."""

    def __init__(self, r=4):
        super().__init__()
        self.norm, self.a = nn.LayerNorm(H), nn.Linear(H, r, bias=False)
        self.b, self.down = nn.Linear(r, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.b(torch.tanh(self.a(self.norm(x))))))


def _plan(model, args, kwargs=None):
    return build(model, TPComm(rank=0, size=2), args, kwargs or {}).plan


def _x():
    return torch.randn(2, 3, H, generator=torch.Generator().manual_seed(0))


def test_every_gpt_layer_costs_megatrons_two_and_two():
    model, args, kwargs = models.build("gpt")
    plan = _plan(model, args, kwargs)
    inside = [c for c in plan.comm if c.layer != "outside the layers"]
    assert [c.layer for c in inside] == ["h.0", "h.1"]
    assert all(len(c.forward) == 2 and len(c.backward) == 2 and not c.above_bound for c in inside)
    assert per_layer(plan.comm) == (2.0, 2.0) and not plan.above_bound
    assert "activation collectives per layer" in str(plan) and "h.0..1" in plan.comm_table()


def test_a_layer_above_the_bound_names_its_regions():
    plan = _plan(Stack(ThreeMLPs), (_x(),))
    assert per_layer(plan.comm) == (3.0, 3.0)
    assert [c.layer for c in plan.above_bound] == ["layers.0", "layers.1"]
    note = plan.above_bound[0].note
    assert note.startswith("3 regions, each closed by its own collective")
    for part in ("first", "second", "third"):
        assert f"g of layers.0.{part}.down [2x3x16]" in note
    assert "3 regions" in plan.comm_table()


def test_one_process_and_replicated_models_have_no_audit():
    plan = build(Stack(MLP), TPComm(rank=0, size=1), (_x(),)).plan
    assert plan.comm == () and "activation collectives" not in str(plan)


def test_a_low_rank_pair_keeps_its_down_projection_replicated():
    plan = _plan(Stack(LowRank), (_x(),))
    weights = {w.key: w.placement for w in plan.weights}
    assert weights["layers.0.a.weight"] == "R"  # r*h redundant FLOPs, no all-reduce of 4h values
    assert weights["layers.0.b.weight"] == "S(0)" and weights["layers.0.down.weight"] == "S(1)"
    reasons = [r.reason for r in plan.regions if r.reason]
    wide = "64 values per token, more than the 16 the region reads and the 4 it contracts (a low-rank pair)"
    assert any(wide in r for r in reasons), reasons
    assert all(max(c.shape[-1] for c in layer.forward) == H for layer in plan.comm if layer.forward)


def test_an_mlp_narrower_inside_is_still_split():
    weights = {w.key: w.placement for w in _plan(Stack(SmallInner), (_x(),)).weights}
    assert weights["layers.0.mlp.up.weight"] == "S(0)" and weights["layers.0.mlp.down.weight"] == "S(1)"


@pytest.mark.gloo
def test_a_low_rank_pair_is_exact_and_sharded():
    torch.manual_seed(0)
    model, x = Stack(LowRank), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.56, share  # b and down split; a and the norms whole


def _sequence_parallel_plan(name: str, **options):
    import fxpar

    model, args, kwargs = models.build(name)
    return build(model, TPComm(rank=0, size=2), args, kwargs,
                 config=fxpar.Config(sequence_parallel=True, **options))


def test_sequence_parallel_collectives_are_listed_under_the_pass_that_runs_them():
    """Each layer of the GPT at t=2 with sequence parallelism, as Korthikanti et al. (2022) lay out Megatron's: forward
    2 all-gathers (into the column-parallel GEMMs) and 2 reduce-scatters (after the row-parallel ones); backward the
    conjugates (2 reduce-scatters, 2 all-gathers) and the 2 saved blocks gathered again. Megatron's bound for the
    layer is 4 + 6, not 2 + 2, and no layer is above it."""
    plan = _sequence_parallel_plan("gpt").plan
    inside = [c for c in plan.comm if c.layer != "outside the layers"]
    assert [c.layer for c in inside] == ["h.0", "h.1"]
    for c in inside:
        assert Counter((x.op, x.kind) for x in c.forward) == {("all-gather", "seq_gather_linear"): 2,
                                                              ("reduce-scatter", "seq_reduce_scatter"): 2}, c
        assert Counter((x.op, x.kind) for x in c.backward) == {("all-gather again", "seq_gather_linear"): 2,
                                                               ("reduce-scatter", "seq_gather_linear"): 2,
                                                               ("all-gather", "seq_reduce_scatter"): 2}, c
        assert [x.kind for x in c.small] == ["seq_weights"]
        assert c.sequence and c.bound == (4, 6) and not c.above_bound
    assert per_layer(plan.comm) == (4.0, 6.0) and not plan.above_bound
    rows = [line.split() for line in plan.comm_table().splitlines()]
    assert rows[2] == ["h.0..1", "4", "6", "1", "4", "+", "6"], plan.comm_table()


def test_the_check_ledger_with_sequence_parallelism():
    """`fxpar check --sequence-parallel`'s ledger on rank 0 of the GPT (b=2, s=8, h=32, fp32, m=1): forward all-gathers
    read this rank's block (2x4x32), reduce-scatters the whole partial sum (2x8x32); the Megatron column is 4 + 6."""
    from fxpar.check import CheckResult, CheckSpec
    from fxpar.cli.check_command import ledger

    pm = _sequence_parallel_plan("gpt")
    spec = CheckSpec("gpt", config={"sequence_parallel": True})
    text = ledger(CheckResult("exact", spec, ledger=list(pm.plan.comm)))
    layer = ("2 all-gather (seq_gather_linear), 2 reduce-scatter (seq_reduce_scatter)  6.0 KiB       "
             "2 all-gather again (seq_gather_linear), 2 reduce-scatter (seq_gather_linear), 2 all-gather "
             "(seq_reduce_scatter)  8.0 KiB       1 seq_weights")
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[2].startswith(f"h.0                 {layer}") and lines[2].endswith("0.1 KiB       4 + 6"), text
    assert lines[3].startswith(f"h.1                 {layer}") and lines[3].endswith("0.1 KiB       4 + 6"), text
    assert lines[4].startswith("outside the layers  1 all-gather (seq_gather_linear), 1 gather"), text
    assert "1 all-gather again (seq_gather_linear), 1 reduce-scatter (seq_gather_linear)" in lines[4], text
    assert lines[4].endswith("-"), text
    assert lines[5] == ("Megatron with sequence parallelism (Korthikanti et al. 2022), per layer: forward 2 all-gather, "
                        "2 reduce-scatter; backward 2 all-gather again, 2 reduce-scatter, 2 all-gather (the "
                        "conjugates, and the column-parallel GEMMs' saved blocks gathered again)"), text
    assert "ABOVE" not in text


def test_the_check_ledger_without_sequence_parallelism_is_megatrons_two_and_two():
    from fxpar.check import CheckResult, CheckSpec
    from fxpar.cli.check_command import ledger

    model, args, kwargs = models.build("gpt")
    pm = build(model, TPComm(rank=0, size=2), args, kwargs)
    lines = [line.split() for line in
             ledger(CheckResult("exact", CheckSpec("gpt"), ledger=list(pm.plan.comm))).splitlines()]
    assert lines[2] == ["h.0", "2", "g", "4.0", "KiB", "2", "f", "4.0", "KiB", "-", "-", "2", "+", "2"], lines
    assert len(lines) == 5  # no legend


@pytest.mark.parametrize("name, options", [("gpt2", {}), ("llama", {"recompute": "selective"})])
def test_the_audit_names_the_all_gathers_that_run_joined_with_their_gemms(name, options):
    """The audit reads the graph right after tensor parallelism; gathered_gemms_pass joins an all-gather with its
    GEMMs later (saving the block, gathering it again in backward). The audit's seq_gather_linear are the joined ops
    of the program that runs, its seq_gather the ones left alone (GPT-2's LM head reads its gather through a view)."""
    from fxpar.passes.ir.meta import Comm, comm_kind

    pm = _sequence_parallel_plan(name, **options)
    ran = Counter(comm_kind(n) for n in pm.compiled.gm.graph.nodes)
    said = Counter(x.kind for c in pm.plan.comm for x in c.forward)
    assert said[Comm.SEQ_GATHER_LINEAR] == ran[Comm.SEQ_GATHER_LINEAR] > 0, (said, ran)
    assert said[Comm.SEQ_GATHER] == ran[Comm.SEQ_GATHER], (said, ran)
