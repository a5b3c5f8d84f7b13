"""Config(joint_graph=True): each chunk runs as its joint forward+backward program (passes/joint/), every collective
a node of it. Over gloo, against the unmodified model: exact to 1e-5 at t=2 (with sequence parallelism too),
(p, t) = (2, 2), (d, t) = (2, 2) and (p, d) = (2, 2); and each layer's collectives, read from the programs (pm.plan.program_comm),
are what the dispatcher sees run: the same functional collectives, forward and backward, step for step. Each rank
runs in a process of its own (AOT autograd's tracing state is not shared between threaded ranks)."""
import contextlib
import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests import models
from tests.harness import module_pool
from tests.models import sgd_gaps, step_gaps
from fxpar.passes.joint.export import OVERLAP_NAMES
from fxpar.passes.sharding.comm_audit import DP_ROW

pool2 = module_pool(2, timeout_s=240.0)
pool4 = module_pool(4, timeout_s=240.0)


class _Seen(TorchDispatchMode):
    """What the dispatcher runs: every c10d functional collective (the programs' collectives, in place or not), by
    op, "all_reduce" (the waits left out)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
            self.ops[func._opname.removesuffix("_").removesuffix("_into_tensor").removesuffix("_tensor")] += 1
        return func(*args, **(kwargs or {}))


def _from_plan(rows) -> tuple[Counter, Counter]:
    fwd, bwd = Counter(), Counter()
    for r in rows:
        fwd.update(r.forward), bwd.update(r.backward)
    return fwd, bwd


def _tensor_parallel(sequence_parallel: bool):
    """t=2: forward and parameter gaps after SGD, the plan's per-layer rows, and the functional collectives the
    dispatcher saw in one forward and one backward."""
    import fxpar

    model, args, kwargs = models.build("gpt")
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                           config=fxpar.Config(joint_graph=True, sequence_parallel=sequence_parallel))
    pm(*args, **kwargs)  # the first call traces its program
    with _Seen() as fwd:
        out = pm(*args, **kwargs)
    with _Seen() as bwd:
        out.sum().backward()
    pm.zero_grad(set_to_none=True)
    rows = pm.plan.program_comm
    return (*sgd_gaps(pm, reference, args, kwargs), [(r.layer, r.forward, r.backward) for r in rows], rows,
            fwd.ops, bwd.ops)


@pytest.mark.gloo
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_joint_program_is_exact_and_counts_what_runs(pool2, sequence_parallel):
    for fwd_gap, param_gap, layers, rows, fwd, bwd in pool2.run(_tensor_parallel, sequence_parallel):
        assert fwd_gap <= 1e-5 and param_gap <= 1e-5, (fwd_gap, param_gap)
        inside = {(f, b) for layer, f, b in layers if layer.startswith("h.")}
        assert [layer for layer, _, _ in layers] == ["h.0", "h.1", "outside the layers"]
        if sequence_parallel:  # f, g: all-gather, reduce-scatter; backward re-gathers the two saved blocks
            assert [(Counter(f), Counter(b)) for f, b in inside] == [
                (Counter(all_gather=2, reduce_scatter=2), Counter(all_gather=4, reduce_scatter=2, all_reduce=1))]
        else:  # Megatron's g twice forward, f twice backward
            assert inside == {(("all_reduce",) * 2, ("all_reduce",) * 2)}
        assert _from_plan(rows) == (fwd, bwd), (_from_plan(rows), fwd, bwd)


def _loss_fn(logits, t):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))


def _trained(mesh: dict, config: dict, steps: int = 2):
    """`steps` SGD steps of pm.step against the single-process model: the largest loss and parameter gaps, the
    functional collectives the dispatcher saw in the last step (steps >= 2), and those this rank's plan gives for
    its chunks times the microbatches."""
    import fxpar

    model, _, _ = models.build("gpt")
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    ids, target = torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)
    m = config.get("microbatches", 1)
    dp = mesh.get("dp", 1)
    rows = 8 // m // dp
    pm = fxpar.parallelize(model, fxpar.init_mesh(**mesh), example_args=(ids[:rows],), loss_fn=_loss_fn,
                           example_target=target[:rows], config=fxpar.Config(joint_graph=True, **config))
    seen = _Seen()
    gaps = step_gaps(pm, reference, ids, target, _loss_fn, steps,  # the first step traces its programs
                     around=lambda step: seen if step == steps - 1 else contextlib.nullcontext())
    rows = pm.plan.program_comm  # a pipeline rank's plan: its own chunks'
    return (*gaps, seen.ops, _planned(rows, m), rows)


def _planned(rows, m: int) -> Counter:
    """The functional collectives the plan's rows give a step of m microbatches: each layer's m times, the dp
    buckets' once (the last microbatch's backward program reduces them)."""
    fwd, bwd = _from_plan([r for r in rows if r.layer != DP_ROW])
    _, dp = _from_plan([r for r in rows if r.layer == DP_ROW])
    return Counter({op: n * m for op, n in (fwd + bwd).items()}) + dp


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("mesh, config", [
    ({"tp": 2, "pp": 2}, {"microbatches": 4, "schedule": "1f1b"}),
    ({"tp": 2, "dp": 2}, {"overlap": OVERLAP_NAMES}),  # with dp_buckets: the dp reduction in the program too
    ({"pp": 2, "dp": 2}, {"microbatches": 4, "schedule": "1f1b", "bucket_mb": 0.01, "overlap": OVERLAP_NAMES}),
], ids=["p2t2", "d2t2", "p2d2"])
def test_joint_programs_train_exactly_and_count_what_runs(pool4, mesh, config):
    """At p=2 x d=2 with 1F1B a chunk's last forward runs before its earlier microbatches' backwards: the
    gradient its program reduces is still the whole step's ([Note: dp buckets in the program])."""
    for loss_gap, param_gap, seen, planned, rows in pool4.run(_trained, mesh, config):
        assert loss_gap <= 1e-5 and param_gap <= 1e-5, (loss_gap, param_gap)
        assert seen == planned and planned["all_reduce"] > 0, (seen, planned)
        assert ("dp" in mesh) == any(r.layer == DP_ROW and r.backward for r in rows), rows


def _variant(name: str):
    """t=2 variants of the joint programs: compiled with inductor and both overlap passes (compile=True alone: the
    joint programs are its default), selective recompute, a weight frozen after parallelize (its own program: no
    gradient), and eval under no_grad."""
    import fxpar

    model, args, kwargs = models.build("gpt")
    config = {"compiled": {"compile": True, "overlap": ("early_collectives", "late_waits")},
              "selective": {"recompute": "selective"}, "frozen": {}, "no_grad": {}}[name]
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                           config=fxpar.Config(**({} if name == "compiled" else {"joint_graph": True}), **config))
    assert pm.compiled.joint.on and ("joint forward+backward program" in str(pm.plan)) == (name == "compiled")
    if name == "no_grad":
        pm.eval(), reference.eval()
        with torch.no_grad():
            return (pm(*args, **kwargs) - reference(*args, **kwargs)).abs().max().item(), 0.0, 0
    if name == "frozen":  # the plan traces the signature of a training call first
        assert pm.plan.program_comm and len(pm.rank.programs.runner(pm.compiled, 0).by_signature) == 1
        dict(pm.named_parameters())["h.0.mlp.c_fc.weight"].requires_grad_(False)
        reference.h[0].mlp.c_fc.weight.requires_grad_(False)
    gaps = sgd_gaps(pm, reference, args, kwargs)
    return (*gaps, len(pm.rank.programs.runner(pm.compiled, 0).by_signature))


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["compiled", "selective", "frozen", "no_grad"])
def test_joint_program_variants_are_exact(pool2, name):
    for fwd_gap, param_gap, programs in pool2.run(_variant, name):
        assert fwd_gap <= 1e-5 and param_gap <= 1e-5, (fwd_gap, param_gap)
        if name == "frozen":  # traced again for the new signature
            assert programs == 2, programs


def _saved(recompute: str):
    """The activation bytes one training forward saves for backward, eager and as the joint program, with
    `recompute`; the bytes of the generator states the joint program saves as tensors (torch.utils.checkpoint keeps
    its own outside autograd, where the hooks do not see them); and both gaps after SGD."""
    import fxpar
    from fxpar.runtime.measure import saved_activation_bytes

    model, args, kwargs = models.build("gpt")
    out = {}
    for joint in (False, True):
        reference, net = copy.deepcopy(model), copy.deepcopy(model)
        pm = fxpar.parallelize(net, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                               config=fxpar.Config(joint_graph=joint, recompute=recompute))
        pm(*args, **kwargs)  # the first call traces the joint program
        _, saved = saved_activation_bytes(lambda: pm(*args, **kwargs), [*pm.parameters(), *pm.buffers()])
        states = 0
        if joint:
            forward = pm.rank.programs.runner(pm.compiled, 0).record.forward
            state = torch.get_rng_state()
            states = sum(v.numel() for a in forward.graph.find_nodes(op="output")[0].args[0]
                         if isinstance(v := getattr(a, "meta", {}).get("val"), torch.Tensor)
                         and v.dtype == state.dtype and v.shape == state.shape)
        out[joint] = (saved, states, *sgd_gaps(pm, reference, args, kwargs))
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_recomputation_is_decided_on_the_joint_graph(pool2, recompute):
    """What backward keeps is the min-cut partitioner's choice on the joint graph, around the regions
    Config.recompute tagged: no more bytes than the eager checkpointed program, and exact."""
    for out in pool2.run(_saved, recompute):
        (eager, _, *eager_gaps), (joint, states, *joint_gaps) = out[False], out[True]
        assert max(*eager_gaps, *joint_gaps) <= 1e-5, (eager_gaps, joint_gaps)
        assert joint - states <= eager, (joint, states, eager)
        if recompute == "none":
            assert joint == eager and states == 0, (joint, eager, states)


def _dropout_twins(mesh: dict, sequence_parallel: bool):
    """The example GPT with dropout 0.1, trained two steps of m=2 microbatches by the eager executable and by the
    joint programs from the same seed: (largest loss difference, largest parameter difference, whether every
    dropout's noise was a program input)."""
    import fxpar
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)

    def loss_fn(logits, t):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))

    losses, states, noised = {}, {}, False
    for joint in (False, True):
        config = fxpar.Config(seed=5, microbatches=2, joint_graph=joint, sequence_parallel=sequence_parallel)
        pm = fxpar.parallelize(copy.deepcopy(model).train(), fxpar.init_mesh(**mesh), example_args=(ids[:2],),
                               loss_fn=loss_fn, example_target=target[:2], config=config)
        opt = torch.optim.SGD(pm.parameters(), lr=0.5)
        losses[joint] = []
        for _ in range(2):
            opt.zero_grad()
            losses[joint].append(pm.step(ids, target=target).item())
            opt.step()
        states[joint] = pm.full_state_dict()
        if joint:
            stage = pm.rank.groups.pp_rank
            noised = all(pm.rank.programs.runner(pm.compiled, c.index).noise for c in pm.compiled.partition.chunks
                         if c.index % pm.rank.groups.pp == stage)
    loss_gap = max(abs(a - b) for a, b in zip(losses[False], losses[True]))
    return loss_gap, max((states[False][k] - states[True][k]).abs().max().item() for k in states[False]), noised


@pytest.mark.gloo
@pytest.mark.parametrize("mesh, sequence_parallel", [({"tp": 2}, False), ({"tp": 2}, True), ({"pp": 2}, False)],
                         ids=["t2", "t2-sp", "p2"])
def test_dropout_in_the_joint_programs_draws_the_eager_masks(pool2, mesh, sequence_parallel):
    """[Note: random inputs]: each dropout's noise, drawn on its stream before each call and passed in, is the mask
    the eager executable draws: losses and parameters after two steps agree with it to 1e-5 (on the replicated and
    the sharded streams, on sequence blocks, over a pipeline)."""
    for loss_gap, param_gap, noised in pool2.run(_dropout_twins, mesh, sequence_parallel):
        assert noised and loss_gap <= 1e-5 and param_gap <= 1e-5, (loss_gap, param_gap, noised)
