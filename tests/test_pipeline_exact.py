"""PTD-P over gloo: 3 optimizer steps at several (p, t, d, v) equal single-process full-batch training within 1e-5
(losses and full_state_dict), for every schedule that fits; plus memory in flight and scatter/gather bytes."""
from __future__ import annotations

import copy

import pytest
import torch

from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
pool4 = module_pool(4)
pool8 = module_pool(8, timeout_s=120.0)
TOL = 1e-5


def loss_fn(out, target):
    return torch.nn.functional.cross_entropy(models.first_tensor(out).flatten(0, 1), target.flatten())


def _batch(args, rows):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, models.VOCAB, (rows, args[0].shape[1]), generator=g)
    return ids, torch.randint(0, models.VOCAB, ids.shape, generator=g)


def _train(name, p, t, d, v, schedule, m, steps=3, scatter_gather=True, **options):
    """Max loss and state differences between fxpar and single-process full-batch SGD, and the run's stats."""
    import fxpar

    model, args, kwargs = models.build(name)
    reference = copy.deepcopy(model)
    ids, target = _batch(args, args[0].shape[0] * d * m)
    config = fxpar.Config(microbatches=m, virtual_stages=v, schedule=schedule, scatter_gather=scatter_gather,
                          **options)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                           loss_fn=loss_fn, config=config)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    loss_err = 0.0
    for _ in range(steps):
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pm.step(ids, target=target, **kwargs)
        ref_loss = loss_fn(reference(ids, **kwargs), target)
        ref_loss.backward()
        opt.step(), ref_opt.step()
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
    full, want = pm.full_state_dict(), reference.state_dict()
    assert list(full) == list(want)
    state_err = max((full[k] - want[k]).abs().max().item() for k in want)
    return loss_err, state_err, pm.rank.stats.peak_in_flight, dict(pm.rank.stats.bytes_sent), pm.rank.groups.pp_rank


def _ran_what_was_proven(name, p, v, m):
    """One step at (p, v, m); returns what the compiler proved and what this rank's runtime executed."""
    import fxpar

    model, args, kwargs = models.build(name)
    ids, target = _batch(args, args[0].shape[0] * m)
    config = fxpar.Config(microbatches=m, virtual_stages=v, schedule="interleaved-1f1b")
    pm = fxpar.parallelize(model, fxpar.init_mesh(pp=p), example_args=args, example_kwargs=kwargs, loss_fn=loss_fn,
                           config=config)
    pm.step(ids, target=target, **kwargs)
    program = {r: [str(a) for a in acts] for r, acts in pm.compiled.program.actions.items()}
    boundaries = [(c.boundary_in, c.boundary_out) for c in pm.compiled.partition.chunks]
    executed = [event[0] for event in pm.rank.stats.events]
    return pm.compiled.done, pm.compiled.proof is not None, program, boundaries, executed, pm.rank.groups.pp_rank


def test_the_runtime_runs_the_proven_program(pool2):
    """A real (p=2, v=2) step: each rank executes exactly its proven action list, and the same proof the compiler
    runs accepts the lowered lists (with the chunks' boundaries) when checked again here."""
    from fxpar.passes.pipeline.lower import Program
    from fxpar.passes.pipeline.partition import Chunk
    from fxpar.passes.pipeline.proofs import prove
    from fxpar.passes.pipeline.schedules import parse_schedule

    results = pool2.run(_ran_what_was_proven, "gpt8", 2, 2, 4)
    for done, proven, program, boundaries, executed, pp_rank in results:
        assert "prove" in done and done.index("prove") > done.index("lower") and proven
        assert executed == program[pp_rank]  # what ran is what was proven, action by action
    done, _, program, boundaries, *_ = results[0]
    chunks = [Chunk(i, None, (), b_in, b_out, (i,)) for i, (b_in, b_out) in enumerate(boundaries)]
    lowered = Program(2, 2, 4, {r: tuple(acts) for r, acts in parse_schedule({r: " ".join(a) for r, a in
                                                                               program.items()}).items()})
    assert prove(lowered, chunks).p == 2


def _fits(v):
    return ["gpipe", "1f1b"] if v == 1 else ["interleaved-1f1b", "gpipe"]


def _check(results):
    for loss_err, state_err, *_ in results:
        assert loss_err <= TOL and state_err <= TOL, (loss_err, state_err)


CONFIGS_2 = [(2, 1, 1, 1), (2, 1, 1, 2), (2, 1, 2, 1)]  # (p, t, d, v) on 2, 4 ranks
CONFIGS_4 = [(4, 1, 1, 2), (2, 2, 1, 2)]


@pytest.mark.parametrize("name", ["gpt8", "llama8"])
@pytest.mark.parametrize("p,t,d,v", [c for c in CONFIGS_2 if c[0] * c[1] * c[2] == 2])
def test_exact_2_ranks(pool2, name, p, t, d, v):
    for schedule in _fits(v):
        _check(pool2.run(_train, name, p, t, d, v, schedule, 2 * p))


# every (p, t, d, v) on 4 ranks with the Llama (grouped-query attention, gate/up MLP); the GPT (fused QKV) at p x t
CASES_4 = [("llama8", *c) for c in CONFIGS_4 + [c for c in CONFIGS_2 if c[0] * c[1] * c[2] == 4]] + \
    [("gpt8", 2, 2, 1, 2)]


@pytest.mark.parametrize("name,p,t,d,v", CASES_4)
def test_exact_4_ranks(pool4, name, p, t, d, v):
    for schedule in _fits(v):
        _check(pool4.run(_train, name, p, t, d, v, schedule, p))


def test_exact_8_ranks(pool8):
    """p, t and d together (the GPT meets each pair above and in tests/test_checkpoint.py's resumes)."""
    _check(pool8.run(_train, "llama8", 2, 2, 2, 1, "1f1b", 2))


def test_layers_not_divisible_by_chunks(pool2):
    _check(pool2.run(_train, "gpt5", 2, 1, 1, 2, "interleaved-1f1b", 2))  # 5 layers in 4 chunks


def test_memory_in_flight(pool4):
    """Saved activations: 1F1B keeps at most p - r microbatches on rank r; GPipe all m."""
    m = 8
    for _, _, peak, _, r in pool4.run(_train, "gpt8", 4, 1, 1, 1, "1f1b", m, steps=1):
        assert peak <= 4 - r, (r, peak)
    for _, _, peak, _, r in pool4.run(_train, "gpt8", 4, 1, 1, 1, "gpipe", m, steps=1):
        assert peak == m, (r, peak)


@pytest.mark.parametrize("scatter_gather,divisor", [(True, 2), (False, 1)])
def test_scatter_gather_bytes(pool4, scatter_gather, divisor):
    """b*s*h*4 bytes (fp32) per boundary per microbatch, divided by t with scatter/gather."""
    results = pool4.run(_train, "gpt8", 2, 2, 1, 1, "1f1b", 2, steps=1, scatter_gather=scatter_gather)
    b, s, h = models.BATCH, models.SEQ, 32
    stage0 = [r for r in results if r[4] == 0]
    for *_, sent, _ in stage0:
        forward = {k: v for k, v in sent.items() if k[2] == "F"}
        assert forward and set(forward.values()) == {b * s * h * 4 // divisor}, forward


@pytest.mark.parametrize("name", ["gpt8", "llama8"])
@pytest.mark.parametrize("options", [{"recompute": "full"}, {"recompute": "selective"}, {"fuse": False}])
def test_exact_with_recompute_and_without_fusion(pool2, name, options):
    """Fusion is on by default everywhere above; here recomputation inside chunks, and the unfused graph."""
    _check(pool2.run(_train, name, 2, 1, 1, 2, "interleaved-1f1b", 2, **options))
