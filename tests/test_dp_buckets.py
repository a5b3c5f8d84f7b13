"""The dp gradient reduction in the backward program (passes/joint/dp_buckets.py, fxpar/runtime/buckets.py).

On a simulated rank: which weights share a bucket, the variant graph, and the collectives of its backward program
(each bucket a functional all-reduce, issued while the rest of the backward runs). Over gloo at d=2, against the
single-process model: exact to 1e-5 after SGD steps in fp32 and to 1e-10 after AdamW steps in float64
(tests/test_zero.py says why), with microbatches and small buckets, the distributed optimizer, inductor, and a
weight no gradient reaches; bf16 with fp32 main gradients equals the default executable's training bit for bit;
and the functional collectives the dispatcher runs are the plan's, the dp row once a step.
"""
import copy
import contextlib

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models
from tests.harness import module_pool
from tests.models import step_gaps
from tests.test_joint_export import _program
from tests.test_joint_graph import _Seen, _planned
from tests.test_zero import _adamw
from fxpar.passes.ir.meta import PARAMETER, input_of
from fxpar.passes.joint.comm_table import collectives, program_comm
from fxpar.config import Config
from fxpar.passes.ir.pieces import DPReduce
from fxpar.passes.ir.pieces import buckets as cut_buckets
from fxpar.passes.joint.dp_buckets import FXPAR_DP, grad_order, with_dp_buckets
from fxpar.passes.joint.export import OVERLAP_NAMES
from fxpar.programs import DPBuckets, JointRequest
from fxpar.runtime.joint_runner import JointRunner
from fxpar.passes.ir.op_families import DECOMPOSED_GEMMS
from fxpar.passes.joint.overlap import overlaps
from fxpar.passes.sharding.comm_audit import DP_ROW, program_table

ALL = OVERLAP_NAMES  # the program passes and dp_buckets (not on by default)
pool2 = module_pool(2, timeout_s=240.0)
pool4 = module_pool(4, timeout_s=240.0)
SIMULATED_DP = DPReduce(2, "fxpar-simulated-dp")


def _weights(gm) -> dict[str, int]:
    return {input_of(p).key: p.meta["val"].numel() * 4 for p in gm.graph.find_nodes(op="placeholder")
            if input_of(p).kind == PARAMETER}


def _variant(cap: float, passes=("early_collectives", "late_waits")):
    gm, traced = _program("gpt")
    weights = _weights(gm)
    cut = buckets_of(gm, list(weights), weights, cap)
    dp = DPBuckets(tuple(map(tuple, cut)), SIMULATED_DP, frozenset(weights))
    request = JointRequest(0, False, passes, False, grad_order(gm), dp)
    return gm, traced, cut, JointRunner(gm, request, Config(), 0).record


def buckets_of(gm, keys, nbytes, cap):
    return cut_buckets(grad_order(gm), keys, nbytes, cap)


class TestDPBuckets(expecttest.TestCase):
    def test_buckets_follow_the_gradients(self):
        gm, _ = _program("gpt")
        weights = _weights(gm)
        # the reverse of each weight's first use forward; a bucket closes at the weight that fills it
        buckets = buckets_of(gm, list(weights), weights, 30000)
        self.assertExpectedInline(str([(b[0], b[-1], sum(weights[k] for k in b)) for b in buckets]), """\
[('ln_f.weight', 'h.0.mlp.c_proj.weight', 34368), ('h.0.mlp.c_fc.weight', 'wte.weight', 22592)]""")
        assert sorted(k for b in buckets for k in b) == sorted(weights)
        assert buckets_of(gm, list(weights), weights, float("inf")) == [[k for b in buckets for k in b]]
        assert buckets_of(gm, ["wte.weight"], weights, 1) == [["wte.weight"]]

    def test_the_variant_graph(self):
        gm, _, buckets, _ = _variant(30000)
        variant = with_dp_buckets(gm, buckets, SIMULATED_DP)
        added = [(p.meta[FXPAR_DP], tuple(p.meta["val"].shape)) for p in variant.graph.find_nodes(op="placeholder")
                 if FXPAR_DP in p.meta]
        n = sum(map(len, buckets))
        assert [role for role, _ in added] == [r for b in buckets for r in ["accumulated"] * len(b) + ["handle"] * len(b)]
        assert len(added) == 2 * n
        calls = [node for node in variant.graph.nodes if node.op == "call_module" and node.target.startswith("dp_")]
        assert [c.target for c in calls] == ["dp_bucket_1", "dp_bucket_0"]  # applied in forward order
        for c, b in zip(calls[::-1], buckets):  # each bucket's weights, accumulated gradients and handles
            assert len(c.args) == 3 * len(b) and [input_of(a).key for a in c.args[:len(b)]] == b
            assert all(u.op == "call_function" for w in c.args[:len(b)] for u in w.users if u is not c)
        assert not gm.graph.find_nodes(op="call_module", target="dp_bucket_0")  # the chunk's own graph is untouched

    def test_each_bucket_is_a_collective_of_the_backward_program(self):
        _, traced, buckets, variant = _variant(30000)
        assert collectives(variant.forward) == collectives(traced.forward)
        mine = [(op, node) for op, node in collectives(variant.backward) if node.startswith("dp_bucket_")]
        assert mine == [("all_reduce", "dp_bucket_0"), ("all_reduce", "dp_bucket_1")]
        tp = [c for c in collectives(variant.backward) if not c[1].startswith("dp_bucket_")]
        assert tp == collectives(traced.backward)
        # the first bucket (the last layer's weights) is in flight while layer 0's backward runs: its GEMMs too
        first = next(o for o in overlaps(variant.backward) if o.node == "dp_bucket_0")
        assert sum(n.target in DECOMPOSED_GEMMS for n in first.hidden) >= 6, [n.name for n in first.hidden]
        # each f still hides weight-gradient GEMMs (one less where a bucket wants its layer's first), and the
        # program hides more GEMMs behind collectives than without the buckets
        def hidden(program, f):
            return {o.node: sum(n.target in DECOMPOSED_GEMMS for n in o.hidden) for o in overlaps(program) if f(o.node)}

        with_buckets, alone = hidden(variant.backward, lambda _: True), hidden(traced.backward, lambda _: True)
        assert all(with_buckets[f] >= 1 for f in alone if f != "tp_f_4"), with_buckets
        assert sum(with_buckets.values()) > sum(alone.values()), (with_buckets, alone)

    def test_without_the_passes_a_bucket_waits_at_once(self):
        *_, variant = _variant(30000, passes=())
        assert all(not o.hidden for o in overlaps(variant.backward) if o.node.startswith("dp_bucket_"))

    def test_the_plan_has_a_row_for_them(self):
        gm, traced, _, variant = _variant(30000)
        self.assertExpectedInline(program_table(program_comm([(gm, traced)], dp=[variant], d=2)), """\
layers                    forward program             backward program      GEMMs overlapped
------------------------  --------------------------  ------------------  ------------------
h.0..1                    2 all_reduce                2 all_reduce                         4
outside the layers        1 all_reduce, 1 all_gather  1 all_reduce                         1
dp buckets (once a step)  -                           2 all_reduce                         7""")


def _loss_fn(logits, t):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))


class _Frozen(nn.Module):
    """A weight that no gradient reaches (read through detach), beside one that gets one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.gate = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x * torch.sigmoid(self.gate.weight.detach().sum()))


def _trained(name: str, config: dict, steps: int = 2):
    """pm.step at d=2 with the joint programs against the single-process model: (loss gap, parameter gap, the
    functional collectives the dispatcher saw in the last step, those the plan gives: its layers' times the
    microbatches and its dp row once, the dp row, how many signatures the last microbatch's program traced)."""
    import fxpar

    model = _Frozen() if name == "frozen" else models.build(name)[0]
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids, target = torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)
    m = config.get("microbatches", 1)
    pm = fxpar.parallelize(model, fxpar.init_mesh(dp=2), example_args=(ids[:8 // m // 2],), loss_fn=_loss_fn,
                           example_target=target[:8 // m // 2], config=fxpar.Config(joint_graph=True, overlap=ALL, **config))
    seen = _Seen()
    gaps = step_gaps(pm, reference, ids, target, _loss_fn, steps,
                     around=lambda step: seen if step == steps - 1 else contextlib.nullcontext())
    rows = pm.plan.program_comm
    dp, planned = [r.backward for r in rows if r.layer == DP_ROW], dict(_planned(rows, m))
    from fxpar.runtime.pipeline_executable import Stage

    signatures = [len(program.by_signature) for cb in pm._program_buckets(Stage(pm, pm._planned)).values()
                  for program in cb.programs.values()]
    no_grad = name == "frozen" and dict(pm.named_parameters())["gate.weight"].grad is None \
        and reference.gate.weight.grad is None
    return (*gaps, dict(seen.ops), planned, dp, signatures, no_grad)


@pytest.mark.gloo
@pytest.mark.parametrize("name, config", [
    ("gpt", {}),
    ("gpt", {"microbatches": 2, "bucket_mb": 0.01}),
    ("gpt", {"compile": True}),
    ("frozen", {}),
], ids=["m1", "m2_small_buckets", "compiled", "no_gradient"])
def test_d2_is_exact_and_counts_what_runs(pool2, name, config):
    for loss_gap, param_gap, seen, planned, dp, signatures, no_grad in pool2.run(_trained, name, config):
        assert loss_gap <= 1e-5 and param_gap <= 1e-5, (loss_gap, param_gap)
        assert seen == planned, (seen, planned)
        assert dp and all(ops and set(ops) == {"all_reduce"} for ops in dp), dp
        assert signatures == [1], signatures  # the plan traced the signature the step ran
        if "bucket_mb" in config:
            assert len(dp[0]) > 4, dp
        if name == "frozen":
            assert no_grad


@pytest.mark.gloo
@pytest.mark.parametrize("zero", [0, 1])
def test_adamw_and_the_distributed_optimizer(pool2, zero):
    """m=2 AdamW steps of a Llama at d=2 in float64: each bucket all-reduced, or reduce-scattered into the pieces."""
    for loss_gap, state_gap, _, _ in pool2.run(_adamw, "llama", 1, 1, 2, zero, 5, joint_graph=True, overlap=ALL,
                                                       bucket_mb=0.01):
        assert loss_gap <= models.FLOAT64_TOL and state_gap <= models.FLOAT64_TOL, (loss_gap, state_gap)


def _mixed(zero: int, reduce: str):
    """bf16 with fp32 main gradients at d=2, m=2: the joint programs (dp buckets in the backward program) and the
    default executable, AdamW steps alike from one model: the largest parameter difference, and the dtypes the
    buckets reduced in."""
    import fxpar

    model, args, kwargs = models.build("gpt")
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, models.VOCAB, (args[0].shape[0] * 4, args[0].shape[1]), generator=g)
    mp = fxpar.MixedPrecision(torch.bfloat16, getattr(torch, reduce))
    mesh = fxpar.init_mesh(dp=2)
    pms = [fxpar.parallelize(m, mesh, example_args=args, example_kwargs=kwargs, loss_fn=_loss_fn,
                             config=fxpar.Config(microbatches=2, zero=zero, mixed_precision=mp, joint_graph=joint,
                                                 overlap=ALL if joint else None, bucket_mb=0.01))
           for m, joint in ((model, True), (twin, False))]
    opts = [pm.optimizer(torch.optim.AdamW, lr=1e-2) for pm in pms]
    for _ in range(3):
        for pm, opt in zip(pms, opts):
            opt.zero_grad()
            pm.step(ids, target=ids, **kwargs)
            opt.step()
    a, b = (pm.full_state_dict() for pm in pms)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.gloo
@pytest.mark.parametrize("zero, reduce", [(0, "float32"), (1, "bfloat16")])
def test_bf16_main_gradients_equal_the_default_executables(pool2, zero, reduce):
    for gap in pool2.run(_mixed, zero, reduce):
        assert gap == 0.0, gap


@pytest.mark.parametrize("schedule, p, m, v, expected", [
    ("1f1b", 2, 4, 1, {0: {0}, 1: {1}}),  # past the warm-up each stage has run a backward before its last forward
    ("1f1b", 4, 2, 1, {0: set(), 1: set(), 2: set(), 3: {3}}),  # m <= the warm-up + 1: those stages fill
    ("gpipe", 2, 4, 1, {0: set(), 1: set()}),  # every forward first: always filled
    ("interleaved-1f1b", 2, 4, 2, {0: {2}, 1: {1, 3}})])
def test_which_chunks_hold_their_gradients_before_their_last_forward(schedule, p, m, v, expected):
    """GradBuckets.start fills a zero gradient only where no backward of the chunk runs before its last
    microbatch's forward ([Note: dp buckets in the program]); the lowered schedule says where, once."""
    from fxpar.passes.pipeline.lower import lower_program
    from fxpar.passes.pipeline.schedules import build_schedule
    from fxpar.runtime.interpreter import warm

    program = lower_program(build_schedule(schedule, p, m, v), p, v, m)
    assert {r: warm(program.actions[r], m) for r in range(p)} == expected
