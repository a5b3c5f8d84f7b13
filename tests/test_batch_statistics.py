"""A loss's statistics over the batch's rows ([Note: batch statistics] in passes/data_parallel/batch_statistics.py): a
load-balancing loss multiplies the share of rows routed to each expert by the mean router probability, both over the
whole batch. Found by tracing the loss again at dp times the rows, all-reduced over dp where the loss reads them
nonlinearly, and left each rank's own (the plan says why) where that cannot be proven; exact against one process on
the whole batch at dp=2, m=1."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.harness import module_pool

pool2 = module_pool(2)
H, E, V, S = 8, 4, 16, 4


class Routed(nn.Module):
    """A vocab head beside a router: the loss reads the router's logits."""

    def __init__(self):
        super().__init__()
        self.embed, self.head, self.gate = nn.Embedding(V, H), nn.Linear(H, V), nn.Linear(H, E)

    def forward(self, ids):
        x = torch.tanh(self.embed(ids))
        return self.head(x), self.gate(x)


def balanced(out, target):
    """Cross-entropy plus a load-balancing term: E * sum_e (share of rows whose top expert is e) * (mean
    probability of e), both over every row (histc and a division by the row count read from the shape); and a
    router z-loss, the mean over rows of logsumexp(logits)^2 (linear in the rows: the dp mean makes it the whole
    batch's as it is)."""
    logits, gate = out
    probs = gate.flatten(0, 1).softmax(-1)
    share = torch.histc(probs.argmax(-1).float(), bins=E, min=0, max=E - 1) / probs.shape[0]
    z = torch.logsumexp(gate, -1).pow(2).mean()
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) + 0.1 * E * (share * probs.mean(0)).sum() + \
        1e-3 * z


def peaked(out, target):
    """A statistic that is not a sum, a count or a mean: the largest router logit over the rows, squared."""
    return F.cross_entropy(out[0].flatten(0, 1), target.flatten()) + out[1].amax(dim=(0, 1)).pow(2).sum()


def centered(out, target):
    """The mean router logit over the rows, subtracted from every row (read on the rank's own rows)."""
    gate = out[1].flatten(0, 1)
    return F.cross_entropy(out[0].flatten(0, 1), target.flatten()) + (gate - gate.mean(0)).pow(2).mean()


def plain(out, target):
    return F.cross_entropy(out[0].flatten(0, 1), target.flatten())


def _traces(loss_fn, rows=2, d=2):
    """The program with its loss at `rows` and at d times them."""
    from fxpar.trace import trace

    torch.manual_seed(0)
    model = Routed()
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, V, (rows * d, S), generator=g), torch.randint(0, V, (rows * d, S), generator=g)
    return (trace(model, (ids[:rows],), {}, (loss_fn, target[:rows])).gm,
            trace(model, (ids,), {}, (loss_fn, target)).gm)


def test_a_load_balancing_loss_is_found_with_its_row_count():
    from fxpar.passes.data_parallel.batch_statistics import find_batch_statistics

    stats = find_batch_statistics(*_traces(balanced))
    assert not stats.why, stats.why
    assert sorted(stats.reduce.values()) == ["mean", "sum"], stats.reduce  # probs.mean(0), histc
    assert [k for k, v in stats.reduce.items() if v == "sum"][0].startswith("histc")
    (name, (args, _)), = stats.constants.items()  # / probs.shape[0]: the local 8 rows become the batch's 16
    assert name.startswith("div") and args[1] == 2 * S * 2, (name, args)


def test_the_pass_all_reduces_after_each_statistic_golden():
    """The rewritten graph: each statistic followed by its all-reduce, every reader reading that; the row count the
    share divides by is the whole batch's (simulated ranks: shapes only)."""
    from fxpar.passes.data_parallel.batch_statistics import BatchStatistic, batch_statistics_pass, find_batch_statistics
    from fxpar.passes.tensor_parallel.collectives import TPComm

    local, whole = _traces(balanced)
    stats = find_batch_statistics(local, whole)
    gm = batch_statistics_pass(local, stats, TPComm(rank=0, size=2))
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, (name, kind) in enumerate(stats.reduce.items()):
        users = list(nodes[name].users)
        assert [u.target for u in users] == [f"dp_statistic_{i}"], users
        module = gm.get_submodule(f"dp_statistic_{i}")
        assert isinstance(module, BatchStatistic) and module.kind == kind
        assert str(module) == f"BatchStatistic({kind} of {name} over dp=2)"
    (name, _), = stats.constants.items()
    assert nodes[name].args[1] == 16, nodes[name].args  # 2 rows x 4 tokens here, the batch's 16 over dp=2


@pytest.mark.parametrize("loss_fn, why", [(peaked, "not a sum, a count or a mean"),
                                          (centered, "on the rank's own rows")])
def test_what_cannot_be_proven_stays_each_ranks_and_says_why(loss_fn, why):
    from fxpar.passes.data_parallel.batch_statistics import find_batch_statistics

    stats = find_batch_statistics(*_traces(loss_fn))
    assert why in stats.why and stats.line(2).startswith("each dp rank's own"), stats.why
    assert not stats.reduce or stats.why


def test_a_loss_linear_in_its_rows_needs_nothing():
    from fxpar.passes.data_parallel.batch_statistics import find_batch_statistics

    assert find_batch_statistics(*_traces(plain)) is None


def _train(loss_fn, m: int, steps: int = 3):
    """(loss gaps, parameter gap, plan's loss line, warnings) of SGD steps at dp=2 against one process, float64."""
    import fxpar

    torch.manual_seed(0)
    model = Routed().double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids, target = torch.randint(0, V, (4 * m, S), generator=g), torch.randint(0, V, (4 * m, S), generator=g)
    pm = fxpar.parallelize(model, fxpar.init_mesh(dp=2), example_args=(ids[:2],), loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=m))
    opt, ref_opt = pm.optimizer(torch.optim.SGD, lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    gaps = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad(), ref_opt.zero_grad()
            loss = pm.step(ids, target=target)
            want = loss_fn(reference(ids), target)
            want.backward()
            opt.step(), ref_opt.step()
            gaps.append(abs(loss.item() - want.item()))
    full, ref = pm.full_state_dict(), reference.state_dict()
    return gaps, max((full[k] - ref[k]).abs().max().item() for k in ref), pm.plan.loss, [str(w.message) for w in said]


def test_statistics_over_the_batch_are_the_whole_batchs_at_dp2(pool2):
    for gaps, gap, line, _ in pool2.run(_train, balanced, 1):
        assert max(gaps) <= 1e-10 and gap <= 1e-10, (gaps, gap)
        assert "statistics over the batch: 2 reduction(s) over the batch's rows all-reduced over dp=2" in line, line


def test_with_microbatches_the_statistics_span_microbatch_i_and_step_says_so(pool2):
    """m=2: the statistics are over the dp ranks' microbatch i, not the whole batch (a pipeline computes microbatch
    i's loss before it runs the others); step() says so once, and the result is not the whole batch's."""
    for gaps, _, _, said in pool2.run(_train, balanced, 2, 1):
        assert sum("microbatch i, not over the whole batch (m=2)" in s for s in said) == 1, said
        assert gaps[0] > 1e-6, gaps  # a different (Megatron's global-over-dp) statistic: said, not silent


class Fixed(Routed):
    """A model that only takes its example's batch size."""

    def forward(self, ids):
        if ids.shape[0] != 2:
            raise ValueError(f"this model takes 2 rows, got {ids.shape[0]}")
        return super().forward(ids)


def test_a_model_that_cannot_take_d_times_the_rows_keeps_each_ranks_statistics_and_says_why():
    """The compiler's second trace (simulated dp=2: shapes only) fails: nothing changes, the plan says why."""
    from fxpar.compiler import Target, compile_model
    from fxpar.config import Config
    from fxpar.passes.tensor_parallel.collectives import TPComm

    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, S))
    c = compile_model(Fixed(), (ids,), {}, Target(TPComm(0, 1), pipelined=True, dp=TPComm(0, 2)), Config(),
                      loss=(balanced, ids))
    assert "does not trace at dp=2 times the rows" in c.statistics.why and "takes 2 rows, got 4" in \
        c.statistics.why, c.statistics.why
    assert not any(n.op == "call_module" for n in c.gm.graph.nodes)
    plain = compile_model(Routed(), (ids,), {}, Target(TPComm(0, 1), pipelined=True, dp=TPComm(0, 2)), Config(),
                          loss=(balanced, ids))
    assert sorted(plain.statistics.reduce.values()) == ["mean", "sum"]
    assert sum(n.op == "call_module" for n in plain.gm.graph.nodes) == 2  # simulated: shapes only, nothing runs
