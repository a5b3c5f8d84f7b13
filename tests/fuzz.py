"""The differential fuzzer: generated models (tests/fuzz_models.py) against fxpar at t=2, and p=2, t=2.

Each model runs on 2 tensor-parallel ranks, threads of one process on torch's threaded process group
(torch.testing._internal.distributed.multi_threaded_pg), real collectives and no fake of them. The outcome is:

    exact      forward and every parameter after one SGD step within 1e-5 of the unmodified model (relative to
               the values' size when they exceed 1); with two layers or more, also the model cut into p=2 chunks
               and run chunk after chunk (the boundaries fxpar chose), forward and SGD step. A float32 gap above
               1e-5 is rerun in float64, where the rewrite must agree to 1e-10 (see run_one)
    refused    fxpar said clearly why it cannot (its TraceError, or a ValueError naming fxpar): allowed. A model
               whose source expects a refusal (EXPECT_REFUSAL: a custom autograd.Function) is counted as "refused
               as expected" when the refusal names it
    skipped    the mode cannot use the model (--loss: an input that is not batch-first): counted, allowed
    mismatch   numbers differ: never allowed
    unrefused  a model that expects a refusal got none (or another): its Function's backward would be dropped, a
               silent wrong result. Never allowed
    crash      any other exception, from inside a pass or the runtime: never allowed
    hang       a rank did not finish within the timeout: never allowed
    invalid    the model itself fails (a generator bug): counted, must stay 0

    python -m tests.fuzz --count 5000 [--start 0] [--out fuzz-failures]   (`make fuzz N=...`)

The modes, which combine:

    --sequence-parallel           every build with Config(sequence_parallel=True)
    --joint-graph                 every chunk as its joint forward+backward program, Config(joint_graph=True)
    --config KEY=VALUE            any other fxpar.Config field that changes the program, parsed as its field's type
                                  (repeatable): recompute=selective, recompute=full, fuse=false, overlap=late_waits
                                  (with --joint-graph; overlap= for none, dp_buckets with --loss), compile=true
                                  (slow), and with --loss microbatches=4, zero=1, check_replicas_every=1.
                                  mixed_precision is not fuzzed (NOT_FUZZED says why)
    --loss [--dp D]               train instead of one forward: loss_fn=F.cross_entropy over the first output's last
                                  dim (token_loss), pm.step over Config(microbatches=2) (or --config's) at t=2,
                                  d=D (default 2; pp stays 1, the threaded group has no point-to-point), on a
                                  global batch of m x d times the example's rows, whose targets ignore a fresh
                                  random share (0 to all) in each microbatch: STEPS SGD steps (of a size the
                                  reference's gradient norm bounds, the same on both sides) against one process on
                                  the whole batch, the losses and every parameter to the same tolerance and float64
                                  arbiter (check_loss). A model whose inputs are not batch-first is skipped
    --loss --dp D --ep E          the same over init_mesh(dp=D, ep=E), every generated model's MLPs mixtures of
                                  experts (tests/fuzz_models.py): exact, and counted "expert parallel" where its
                                  experts were split over ep

prints the counts (with the CPU seconds, which a loaded machine does not inflate as it does the wall-clock) and
writes each failing model as a standalone file (its mode, the model's source and a driver that reruns the check)
into --out.
"""
from __future__ import annotations

import copy
import os
import re
import sys
import traceback
import warnings
from collections import Counter

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fuzz_models import expected_refusal, generate, load  # noqa: E402
from tests.threaded import RankHang, Threaded, on_ranks  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
OPTIONS: dict = {}  # more fxpar.Config fields for every build (--config, --sequence-parallel, --joint-graph)
LOSS: dict = {}  # --loss: {"dp": d}, train each model with a token loss through pm.step (check_loss)
BAD = ("mismatch", "crash", "hang", "invalid", "unrefused")
LR, STEPS = 0.1, 2  # --loss: SGD steps, on both sides (the step size: _train)
MICROBATCHES = 2  # --loss: Config.microbatches unless --config says otherwise
IGNORE = -100  # the targets' ignore_index
# Config fields no mode fuzzes, and why
NOT_FUZZED = {"mixed_precision": "low-precision compute cannot agree with the float32 reference to 1e-5 "
                                 "(tests/test_mixed_precision.py checks it against the same recipe on one process)"}


class Skip(Exception):
    """A model the mode cannot use (--loss: an input or the first output that is not batch-first)."""


def _gap(got, want) -> float:
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def _state_gap(full: dict, ref: dict) -> float:
    return max((_gap(full[k], ref[k]) for k in ref), default=0.0)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _sgd_gap(pm_params, pm_full, reference, got, want) -> float:
    """Run one SGD step on both sides from outputs got / want; return the largest parameter gap.

    The loss is mean(sin(y)) of the first output, and both backwards start from the reference's gradient of it,
    cos(want) / numel: the forward is compared on its own, and this compares the backward alone. (Started from
    each side's own cos(y), a model whose outputs reach 1e17 would compare two values of cos at points float64
    itself cannot resolve: noise, not the rewrite.)"""
    first = _first(want).detach()
    upstream = first.cos() / first.numel()
    for params, y in ((pm_params, got), (list(reference.parameters()), want)):
        opt = torch.optim.SGD(params, lr=0.1)
        _first(y).backward(upstream.to(_first(y).dtype))
        opt.step()
    return _state_gap(pm_full(), reference.state_dict())


def token_loss(out, target):
    """--loss's loss_fn: the token mean of F.cross_entropy over the first output's last dim as the classes (its
    other dims flattened), targets of ignore_index left out."""
    return F.cross_entropy(_first(out).flatten(0, -2), target.flatten(), ignore_index=IGNORE)


def _train(opt, step, rates: list[float] | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """(losses, step sizes) of STEPS SGD steps of `opt`, each after step() (the forward and backward). The step
    size is `rates`' (the reference's), or where none are given LR / max(1, the gradient's norm): the update's norm
    stays under LR, so that an ill-conditioned model (logits of 1e20) takes its second step from finite weights."""
    losses, used = [], []
    for i in range(STEPS):
        opt.zero_grad()
        losses.append(step().detach())
        if rates is None:
            grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
            used.append(LR / max(1.0, torch.nn.utils.get_total_norm(grads).item()))
        else:
            used.append(rates[i])
        for group in opt.param_groups:
            group["lr"] = used[-1]
        opt.step()
    return losses, used


def _train_reference(model, batch, target) -> tuple[list[torch.Tensor], list[float]]:
    """One process on the whole global batch: STEPS SGD steps on token_loss (see _train)."""
    args, kwargs = batch

    def step():
        loss = token_loss(model(*args, **kwargs), target)
        loss.backward()
        return loss

    return _train(torch.optim.SGD(model.parameters(), lr=LR), step)


def _chained(pm, args, kwargs):
    """Run a pipelined ParallelModule's chunks one after another on this rank (autograd flows through)."""
    import torch.utils._pytree as pytree

    program = pm.compiled
    flat = pm._flatten_inputs(args, kwargs)
    received = []
    for chunk in program.partition.chunks:
        run = pm.rank.programs.runner(program, chunk.index)
        received = list(run(*pm._chunk_inputs(chunk, flat, received, program)))
    return pytree.tree_unflatten(received, program.traced.out_spec)


def _tracing():
    """With joint programs (--joint-graph, or compile=true): hold the joint export's lock, so that this rank's
    compiler passes do not run while another rank, a thread of this process, traces a joint program
    (passes/joint/export.py TRACING). It is held over compilation only, which runs no collective."""
    import contextlib

    from fxpar.passes.joint.export import TRACING

    joint = OPTIONS.get("joint_graph") or (OPTIONS.get("joint_graph") is None and OPTIONS.get("compile"))
    return TRACING if joint else contextlib.nullcontext()


def _refusal(e: Exception) -> str | None:
    """The reason of a clear refusal, or None when the exception is not one: fxpar's own TraceError, or a
    ValueError or TypeError naming fxpar."""
    from fxpar.trace import TraceError

    text = str(e)
    if not (isinstance(e, TraceError) or isinstance(e, (ValueError, TypeError)) and "fxpar" in text):
        return None
    first = text.split("\n")[0].removeprefix("fxpar:").strip()
    if first.startswith("cannot split"):  # "cannot split N region(s) over t=2. First: module m, GEMMs g: why."
        first = "cannot split: " + first.rsplit(": ", 1)[-1]
    return re.sub(r"\d+", "N", first)[:100]


def _failed(e: Exception, where: str = "") -> dict:
    """The outcome of an exception: refused (with its reason, and its first line whole), or a crash."""
    reason = _refusal(e)
    if reason:
        return {"outcome": "refused", "reason": reason, "message": str(e).split("\n")[0]}
    return {"outcome": "crash", "detail": where + traceback.format_exc()}


def _config():
    import fxpar

    return fxpar.Config(**{"seed": 0, "microbatches": MICROBATCHES if LOSS else 1} | OPTIONS)


def _pieces() -> int:
    """--loss: the global batch's pieces, microbatches times dp slices."""
    return _config().microbatches * LOSS["dp"]


def build_model(source: str):
    """(model, args, kwargs, call_args, call_kwargs) of a generated source: the example it is traced with and the
    inputs it is checked on (which may alias differently); build it in one thread (its weights come from the
    global generator, which threads share) and hand each rank a copy. With --loss, (model, args, kwargs,
    (global args, global kwargs), target) instead: the global batch and its targets (raises Skip where the model
    cannot take one)."""
    Model, example, call = load(source)
    torch.manual_seed(0)
    model = Model()
    if not LOSS:
        return (model, *example(), *call())
    batch = _global_batch(call, _pieces())
    return (model, *example(), batch, _targets(model, batch, source))


def _global_batch(call, pieces: int) -> tuple:
    """call(rows=pieces * rows): the check's inputs at `pieces` times the example's rows, where every input is
    batch-first (its rows, dim 0, are what `rows` scales, as pm.step splits them); else raise Skip."""
    import inspect

    import torch.utils._pytree as pytree

    rows = inspect.signature(call).parameters.get("rows")
    if rows is None:
        raise Skip("the model's call() takes no batch size")
    one, spec = pytree.tree_flatten(call())
    whole, whole_spec = pytree.tree_flatten(call(rows=rows.default * pieces))
    for i, (a, b) in enumerate(zip(one, whole)):
        if isinstance(a, torch.Tensor) and tuple(b.shape) != (a.shape[0] * pieces, *a.shape[1:]):
            raise Skip(f"input {i} is not batch-first: {tuple(a.shape)} at rows={rows.default}, {tuple(b.shape)} at "
                       f"rows={rows.default * pieces}")
    assert spec == whole_spec, (spec, whole_spec)
    return pytree.tree_unflatten(whole, whole_spec)


def _targets(model, batch, source: str) -> torch.Tensor:
    """Class targets for the model's first output on the global batch, its last dim the classes: each of the
    _pieces() microbatch row blocks ignores a fresh random share of them (ignore_index), 0 and all each one time in
    six, so that counts are uneven and a microbatch with no valid target is common; the batch keeps at least one.
    Drawn from the source's SEED (a saved reproduction draws the same), else from its text."""
    import zlib

    seed = re.search(r"^SEED = (\d+)", source, re.M)
    with torch.no_grad():
        out = _first(model(*batch[0], **batch[1]))
    rows = next(x.shape[0] for x in batch[0])
    if out.dim() < 2 or out.shape[0] != rows:
        raise Skip(f"the first output {tuple(out.shape)} is not batch-first with classes last (rows {rows})")
    g = torch.Generator().manual_seed(int(seed.group(1)) if seed else zlib.crc32(source.encode()))
    target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
    for block in target.chunk(_pieces()):
        share = min(1.0, max(0.0, 1.5 * torch.rand((), generator=g).item() - 0.25))
        block.masked_fill_(torch.rand(block.shape, generator=g) < share, IGNORE)
    if (target == IGNORE).all():
        target.view(-1)[-1] = 0
    return target


def check(model, args, kwargs, cargs, ckwargs, mesh, traced=None) -> dict:
    """The outcome of one generated model on this rank (see the module docstring), to TOL of its dtype: traced
    and built on (args, kwargs), checked on (cargs, ckwargs). traced: the model's trace, made once for all ranks
    and both builds (tracing is most of the time)."""
    from fxpar.api import build
    from fxpar.compiler import retarget
    from fxpar.mesh import tp_comm
    from fxpar.runtime.executable import ParallelModule

    tol = TOL[next(model.parameters()).dtype]
    reference, chain_model, chain_ref = (copy.deepcopy(model) for _ in range(3))
    try:
        want = reference(*cargs, **ckwargs)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    if not all(torch.isfinite(w).all() for w in _flat(want)):
        return {"outcome": "invalid", "detail": "the unmodified model's output is not finite"}
    warnings.filterwarnings("ignore", message="fxpar: found nothing to shard")  # counted as "exact, replicated"
    try:
        with _tracing():  # the plan traces the joint programs (--joint-graph)
            pm = build(model, tp_comm(mesh), args, kwargs, mesh, _config(), traced=traced)
        first = pm.compiled  # before the step: the program the p=2 check cuts (retarget shares its stages)
        got = pm(*cargs, **ckwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(want)))
        params = _sgd_gap(list(pm.parameters()), pm.full_state_dict, reference, got, want)
    except Exception as e:
        return _failed(e)
    result = {"outcome": "exact" if max(fwd, params) <= tol else "mismatch", **_shape_of(pm),
              "gap": max(fwd, params), "detail": f"t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
    if not _everyone(result["outcome"] == "exact") or len(model.layers) < 2:
        return result  # every rank takes the same branch, or one would wait in a collective alone
    try:
        with _tracing():
            pp = ParallelModule(chain_model, retarget(first, chain_model, pp=2))  # its plan traces the chunks' joint
            # programs now (--joint-graph)
        got = _chained(pp, cargs, ckwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(chain_ref(*cargs, **ckwargs))))
        params = _sgd_gap(list(pp.parameters()), pp.full_state_dict, chain_ref, got, chain_ref(*cargs, **ckwargs))
    except Exception as e:
        failed = _failed(e, "p=2: ")
        if failed["outcome"] == "refused":
            return result | {"pipeline": "refused", "pipeline_reason": failed["reason"]}
        return failed
    if max(fwd, params) > tol:
        return {"outcome": "mismatch", "gap": max(fwd, params),
                "detail": f"p=2 t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
    return result | {"pipeline": "exact"}


def _shape_of(pm) -> dict:
    """What a build did, for the counts: whether it sharded a region, whether it ran sequence blocks, whether it
    split experts over ep."""
    experts = pm.compiled.experts
    return {"sharded": bool(pm.plan.sharded_regions),
            "blocks": pm.compiled.sequence is not None and pm.compiled.sequence.applied,
            "experts": pm.compiled.target.ep.size > 1 and experts is not None and bool(experts.chains)}


def check_loss(model, args, kwargs, batch, target, mesh, traced) -> dict:
    """--loss: the outcome of training one generated model on this rank: parallelized with loss_fn=token_loss
    (traced with it, `traced`) over `mesh` (t=2, d=LOSS["dp"]) at Config.microbatches m, STEPS SGD steps of
    pm.step on the global batch (global args, global kwargs) = `batch` and its `target`, against one process
    training on the whole batch: the losses and every parameter to TOL of its dtype."""
    from fxpar.api import build
    from fxpar.mesh import tp_comm

    tol = TOL[next(model.parameters()).dtype]
    reference = copy.deepcopy(model)
    try:
        want, rates = _train_reference(reference, batch, target)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    if not all(torch.isfinite(w) for w in want) or not all(p.isfinite().all() for p in reference.parameters()):
        return {"outcome": "invalid", "detail": f"the unmodified model's training is not finite: losses {want}"}
    warnings.filterwarnings("ignore", message="fxpar: found nothing to shard")
    config = _config()
    try:
        with _tracing():
            pm = build(model, tp_comm(mesh), args, kwargs, mesh, config, loss_fn=token_loss, traced=traced)
        got, _ = _train(pm.optimizer(torch.optim.SGD, lr=LR), lambda: pm.step(*batch[0], target=target, **batch[1]),
                        rates)
        losses, params = _gap(torch.stack(got), torch.stack(want)), _state_gap(pm.full_state_dict(),
                                                                             reference.state_dict())
    except Exception as e:
        return _failed(e)
    counts = [int((t != IGNORE).sum()) for t in target.chunk(_pieces())]
    return {"outcome": "exact" if max(losses, params) <= tol else "mismatch", **_shape_of(pm),
            "gap": max(losses, params),
            "detail": f"t=2 d={LOSS['dp']} m={config.microbatches}, valid targets per microbatch {counts}, {STEPS} "
                      f"SGD steps: loss gap {losses:.3g}, parameters {params:.3g}; the plan's loss: {pm.plan.loss}"}


def _everyone(flag: bool) -> bool:
    """flag on every rank (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_one(source: str, tp: int = 2, timeout_s: float = 120.0) -> dict:
    """Check one model on `tp` threaded ranks (times LOSS's dp with --loss); the worst rank's outcome. A model whose
    source expects a refusal (EXPECT_REFUSAL: a custom autograd.Function) must get one that names it: any other
    outcome is "unrefused", a wrong result the trace would otherwise have let through.

    A float32 mismatch is arbitrated in float64: a model can amplify rounding (a chain of unnormalized products)
    until reordering a sum moves its float32 numbers by more than 1e-5, which says nothing about the rewrite. In
    float64 the same rewrite must agree to 1e-10, and the float32 gap must be within 10x of the unmodified model's
    own float32 error (its float32 run against its float64 run); only then is the outcome "exact" (counted as
    "float64 arbiter"). A model so ill-conditioned that its own float32 error is large (outputs of 1e7 through a
    sine) amplifies float64 rounding too: its float64 gap may then reach 100x that error scaled by the ratio of the
    two machine epsilons (what rounding predicts), never more. A wrong rewrite is off by the same amount in
    either precision, far above both bounds.

    [Note: a gap that scales with epsilon] A rewrite can also change how a model amplifies rounding: the fused
    attention (SDPA) recomputes its softmax in backward from the saved log-sum-exp, so attention logits of 1e6 (an
    unnormalized stack whose activations reach 5e6, seed 9501460) lose the probabilities' low bits there, while the
    unmodified model saves them. Its float32 gap is then large (44.9) and its float64 gap 9.2e-8: 2^-29 of it, the
    ratio of the machine epsilons. A gap that shrinks by that ratio in float64 (within 10x) is rounding, whatever
    amplified it; a wrong rewrite's does not shrink. Such models are counted "float64 arbiter" and listed, and
    docs/soundness.md says what the fusion changes."""
    result = _arbitrated(source, tp, timeout_s)
    expected = expected_refusal(source)
    if expected is None or result["outcome"] in ("skipped", "crash", "hang", "invalid"):
        return result
    if result["outcome"] == "refused" and expected in result["message"]:
        return result | {"expected": expected}
    said = result.get("message") or result.get("detail", "")
    return {"outcome": "unrefused", "detail": f"the model calls a {expected}, whose backward a trace drops, and "
                                              f"fxpar did not refuse it: {result['outcome']}: {said}"}


def _arbitrated(source: str, tp: int, timeout_s: float) -> dict:
    """The outcome of one model on its ranks, a float32 mismatch arbitrated in float64 (see run_one)."""
    try:
        built = build_model(source)
    except Skip as e:
        return {"outcome": "skipped", "reason": str(e)}
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    result = _on_ranks(built, tp, timeout_s)
    if result["outcome"] != "mismatch":
        return result
    model, *inputs = built
    wide_built = (copy.deepcopy(model).double(), *map(_double, inputs))
    own = _own_rounding(built, wide_built)
    wide = _on_ranks(wide_built, tp, timeout_s)
    rounding = wide["outcome"] == "exact" and result["gap"] <= 10 * own or wide["outcome"] == "mismatch" and \
        result["gap"] <= 10 * own and wide["gap"] <= 100 * own * _EPS_RATIO
    # [Note: a gap that scales with epsilon]
    scales = wide["outcome"] in ("exact", "mismatch") and wide.get("gap", 1.0) <= 10 * result["gap"] * _EPS_RATIO
    if rounding or scales:
        return wide | {"outcome": "exact", "arbiter": f"float32 {result['detail']}; the unmodified model's own float32 "
                                                      f"error (against float64) {own:.3g}; float64 {wide['detail']}"}
    return wide if wide["outcome"] not in ("refused", "exact") else result


_EPS_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps


def _own_rounding(built, wide_built) -> float:
    """How far the unmodified model's float32 forward and SGD step (with --loss: its training) land from its
    float64 ones."""
    (model, *_, args, kwargs), (wide, *_, wargs, wkwargs) = copy.deepcopy(built), copy.deepcopy(wide_built)
    if LOSS:  # args, kwargs: the global batch and its target
        (got, _), (want, _) = _train_reference(model, args, kwargs), _train_reference(wide, wargs, wkwargs)
        return max(_gap(torch.stack(got).double(), torch.stack(want)), _state_gap(model.state_dict(),
                                                                                  wide.state_dict()))
    got, want = model(*args, **kwargs), wide(*wargs, **wkwargs)
    forward = max(_gap(g.double(), w) for g, w in zip(_flat(got), _flat(want)))
    params = _sgd_gap(list(model.parameters()), lambda: {k: v.double() for k, v in model.state_dict().items()}, wide,
                      got, want)
    return max(forward, params)


def _double(tree):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _on_ranks(built, tp: int, timeout_s: float) -> dict:
    """check() (check_loss() with --loss) on tp x dp threaded ranks, each on its own copy of built (see
    build_model); the worst rank's. The trace is made once, here (torch.export is not thread-safe)."""
    import fxpar
    from fxpar.trace import trace

    dp = LOSS.get("dp", 1)
    copies = [copy.deepcopy(built) for _ in range(tp * dp)]
    model, args, kwargs, *rest = built
    try:
        traced = trace(model, args, kwargs, loss=(token_loss, rest[1].chunk(_pieces())[0]) if LOSS else None)
    except Exception as e:
        return _failed(e)
    run = check_loss if LOSS else check
    try:
        results = on_ranks(lambda r: run(*copies[r], fxpar.init_mesh(tp=tp, dp=dp, ep=LOSS.get("ep", 1)), traced),
                           tp * dp, timeout_s)
    except RankHang as e:
        return {"outcome": "hang", "detail": str(e)}
    results = [r if isinstance(r, dict) else {"outcome": "crash", "detail": r[1]} for r in results.values()]
    order = ["crash", "hang", "invalid", "mismatch", "refused", "exact"]
    return min(results, key=lambda r: order.index(r["outcome"]))


def fuzz(seeds, out_dir: str | None = None) -> dict:
    """The summary over the seeds: outcome counts, the reasons of refusals and skips, failures as (seed, result),
    and the seeds whose float32 gap was arbitrated in float64."""
    counts, reasons, failures, arbitrated = Counter(), Counter(), [], []
    with Threaded():
        for seed in seeds:
            source = generate(seed, experts="ep" in LOSS)
            result = run_one(source)
            outcome = result["outcome"]
            counts[outcome] += 1
            if outcome == "exact":
                counts["exact, sharded" if result.get("sharded") else "exact, replicated"] += 1
                if result.get("blocks"):
                    counts["exact, sequence blocks"] += 1
                if "arbiter" in result:
                    counts["exact, float64 arbiter"] += 1
                    arbitrated.append(seed)
                if result.get("experts"):
                    counts["exact, expert parallel"] += 1
                if "pipeline" in result:
                    counts[f"p=2 chained: {result['pipeline']}"] += 1
                if result.get("pipeline") == "refused":
                    reasons[f"refused, p=2 chained, {result['pipeline_reason']}"] += 1
            if outcome == "refused" and "expected" in result:
                counts[f"refused as expected, {result['expected']}"] += 1
            elif outcome in ("refused", "skipped"):
                reasons[f"{outcome}, {result['reason']}"] += 1
            if outcome in BAD:
                failures.append((seed, result))
                if out_dir:
                    save(out_dir, seed, source, result)
    return {"counts": counts, "reasons": reasons, "failures": failures, "arbitrated": arbitrated}


def fuzz_jobs(start: int, count: int, jobs: int, out_dir: str | None = None) -> dict:
    """fuzz() over seeds start .. start+count-1 in `jobs` processes (one core each), summaries merged."""
    if jobs <= 1:
        return fuzz(range(start, start + count), out_dir)
    import json
    import subprocess
    import tempfile

    bounds = [start + count * j // jobs for j in range(jobs + 1)]
    with tempfile.TemporaryDirectory(prefix="fxpar-fuzz-") as tmp:
        procs = []
        for j in range(jobs):
            cmd = [sys.executable, "-m", "tests.fuzz", "--start", str(bounds[j]), "--count",
                   str(bounds[j + 1] - bounds[j]), "--json", os.path.join(tmp, f"{j}.json"), "--quiet", *mode_argv()]
            if out_dir:
                cmd += ["--out", out_dir]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}))
        for proc in procs:
            proc.wait()
        merged = {"counts": Counter(), "reasons": Counter(), "failures": [], "arbitrated": []}
        for j, proc in enumerate(procs):
            path = os.path.join(tmp, f"{j}.json")
            if not os.path.exists(path):
                merged["failures"].append((bounds[j], {"outcome": "crash", "detail": f"fuzz job {j} (seeds from "
                                                       f"{bounds[j]}) exited with {proc.returncode}"}))
                continue
            with open(path) as f:
                part = json.load(f)
            merged["counts"].update(part["counts"])
            merged["reasons"].update(part["reasons"])
            merged["failures"] += [tuple(x) for x in part["failures"]]
            merged["arbitrated"] += part["arbitrated"]
    return merged


def mode_argv() -> list[str]:
    """The command-line arguments of the current mode (OPTIONS and LOSS), as main() parses them back."""
    def text(v) -> str:
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else \
            ",".join(v) if isinstance(v, (tuple, list)) else str(v)

    argv = [arg for key, v in OPTIONS.items() for arg in ("--config", f"{key}={text(v)}")]
    return argv + (["--loss", "--dp", str(LOSS["dp"])] if LOSS else []) + (["--ep", str(LOSS["ep"])] if "ep" in LOSS
                                                                           else [])


def save(out_dir: str, seed: int, source: str, result: dict) -> str:
    """Write a standalone reproduction: the mode, the model's source, the outcome, and a driver that reruns the
    check (FUZZ_OPTIONS and FUZZ_LOSS: as tests/test_fuzz.py reads a regression)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"fuzz_{seed}.py")
    detail = "\n".join(f"# {line}" for line in result.get("detail", "").splitlines())
    driver = (f'\n\nif __name__ == "__main__":  # python {path}\n    import sys\n    sys.path.insert(0, {ROOT!r})\n'
              "    from tests.fuzz import LOSS, OPTIONS, Threaded, run_one\n"
              "    OPTIONS.update(FUZZ_OPTIONS)\n    LOSS.update(FUZZ_LOSS)\n"
              "    with Threaded():\n"
              "        print(run_one(open(__file__).read()))\n")
    with open(path, "w") as f:
        f.write(f"# fxpar fuzz seed {seed}: {result['outcome']}\n{detail}\nFUZZ_OPTIONS = {OPTIONS!r}\n"
                f"FUZZ_LOSS = {LOSS!r}\n{source}{driver}")
    return path


if __name__ == "__main__":  # the command line lives in tests/fuzz_cli.py, over this module
    from tests.fuzz_cli import main

    sys.exit(main())
