"""The differential fuzzer: generated models (tests/fuzz_models.py) against fxpar at t=2, and p=2, t=2.

Each model runs on 2 tensor-parallel ranks, threads of one process on torch's threaded process group
(torch.testing._internal.distributed.multi_threaded_pg), real collectives and no fake of them. The outcome is:

    exact      forward and every parameter after one SGD step within 1e-5 of the unmodified model (relative to
               the values' size when they exceed 1); with two layers or more, also the model cut into p=2 chunks
               and run chunk after chunk (the boundaries fxpar chose), forward and SGD step. A float32 gap above
               1e-5 is rerun in float64, where the rewrite must agree to 1e-10 (see run_one)
    refused    fxpar said clearly why it cannot (a ValueError or TraceError naming fxpar): allowed
    mismatch   numbers differ: never allowed
    crash      any other exception, from inside a pass or the runtime: never allowed
    hang       a rank did not finish within the timeout: never allowed
    invalid    the model itself fails (a generator bug): counted, must stay 0

    python -m tests.fuzz --count 5000 [--start 0] [--out fuzz-failures]   (`make fuzz N=...`)
    python -m tests.fuzz --count 1000 --sequence-parallel                  (every build with sequence parallelism)
    python -m tests.fuzz --count 1000 --joint-graph                        (every chunk as its joint program)

prints the counts and writes each failing model as a standalone file (the model's source plus a driver that
reruns the check) into --out.
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fuzz_models import generate, load  # noqa: E402
from tests.threaded import RankHang, Threaded, on_ranks  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
OPTIONS: dict = {}  # more fxpar.Config fields for every build (--sequence-parallel, --joint-graph)
BAD = ("mismatch", "crash", "hang", "invalid")


def _gap(got, want) -> float:
    return ((got - want).abs().max() / max(1.0, want.abs().max().item())).item()


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _sgd_gap(pm_params, pm_full, reference, got, want) -> float:
    """Run one SGD step on both sides from outputs got / want; return the largest parameter gap."""
    for params, y in ((pm_params, got), (list(reference.parameters()), want)):
        opt = torch.optim.SGD(params, lr=0.1)
        (_first(y).sin().sum() / _first(y).numel()).backward()
        opt.step()
    full, ref = pm_full(), reference.state_dict()
    return max((_gap(full[k], ref[k]) for k in ref), default=0.0)


def _chained(pm, args, kwargs):
    """Run a pipelined ParallelModule's chunks one after another on this rank (autograd flows through)."""
    import torch.utils._pytree as pytree

    program = pm.compiled
    flat = pm.flatten_inputs(args, kwargs)
    received = []
    for chunk in program.partition.chunks:
        received = list(program.callables[chunk.index](*pm.chunk_inputs(chunk, flat, received, program)))
    return pytree.tree_unflatten(received, program.traced.out_spec)


def _tracing():
    """With --joint-graph: hold the joint export's lock, so that this rank's compiler passes do not run while another
    rank, a thread of this process, traces a joint program (passes/joint/export.py TRACING). It is held over
    compilation only, which runs no collective."""
    import contextlib

    from fxpar.passes.joint.export import TRACING

    return TRACING if OPTIONS.get("joint_graph") else contextlib.nullcontext()


def _refusal(e: Exception) -> str | None:
    """The reason of a clear refusal, or None when the exception is not one."""
    from fxpar.trace import TraceError

    text = str(e)
    if not (isinstance(e, (ValueError, TraceError, TypeError)) and "fxpar" in text):
        return None
    first = text.split("\n")[0].removeprefix("fxpar:").strip()
    if first.startswith("cannot split"):  # "cannot split N region(s) over t=2. First: module m, GEMMs g: why."
        first = "cannot split: " + first.rsplit(": ", 1)[-1]
    return re.sub(r"\d+", "N", first)[:100]


def build_model(source: str):
    """(model, args, kwargs, call_args, call_kwargs) of a generated source: the example it is traced with and the
    inputs it is checked on (which may alias differently); build it in one thread (its weights come from the
    global generator, which threads share) and hand each rank a copy."""
    Model, example, call = load(source)
    torch.manual_seed(0)
    model = Model()
    return (model, *example(), *call())


def check(model, args, kwargs, cargs, ckwargs, mesh, traced=None) -> dict:
    """The outcome of one generated model on this rank (see the module docstring), to TOL of its dtype: traced
    and built on (args, kwargs), checked on (cargs, ckwargs). traced: the model's trace, made once for all ranks
    and both builds (tracing is most of the time)."""
    import fxpar
    from fxpar.api import build
    from fxpar.compiler import retarget
    from fxpar.runtime.executable import ParallelModule, tp_comm

    tol = TOL[next(model.parameters()).dtype]
    reference, chain_model, chain_ref = (copy.deepcopy(model) for _ in range(3))
    try:
        want = reference(*cargs, **ckwargs)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    if not all(torch.isfinite(w).all() for w in _flat(want)):
        return {"outcome": "invalid", "detail": "the unmodified model's output is not finite"}
    config = fxpar.Config(seed=0, **OPTIONS)
    warnings.filterwarnings("ignore", message="fxpar: found nothing to shard")  # counted as "exact, replicated"
    try:
        with _tracing():  # the plan traces the joint programs (--joint-graph)
            pm = build(model, tp_comm(mesh), args, kwargs, mesh, config, traced=traced)
        first = pm.compiled  # before the step: the program the p=2 check cuts (retarget shares its stages)
        got = pm(*cargs, **ckwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(want)))
        params = _sgd_gap(list(pm.parameters()), pm.full_state_dict, reference, got, want)
        sharded = bool(pm.plan.sharded_regions)
        blocks = pm.compiled.sequence is not None and pm.compiled.sequence.applied
    except Exception as e:
        reason = _refusal(e)
        return {"outcome": "refused", "reason": reason} if reason else \
            {"outcome": "crash", "detail": traceback.format_exc()}
    result = {"outcome": "exact" if max(fwd, params) <= tol else "mismatch", "sharded": sharded, "blocks": blocks,
              "gap": max(fwd, params), "detail": f"t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
    if not _everyone(result["outcome"] == "exact") or len(model.layers) < 2:
        return result  # every rank takes the same branch, or one would wait in a collective alone
    try:
        with _tracing():
            pp = ParallelModule(chain_model, retarget(first, chain_model, pp=2))
            pp.plan = pp.make_plan(pp.compiled)  # traces the chunks' joint programs now (--joint-graph)
        got = _chained(pp, cargs, ckwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(chain_ref(*cargs, **ckwargs))))
        params = _sgd_gap(list(pp.parameters()), pp.full_state_dict, chain_ref, got, chain_ref(*cargs, **ckwargs))
    except Exception as e:
        if _refusal(e):
            return result | {"pipeline": "refused", "pipeline_reason": _refusal(e)}
        return {"outcome": "crash", "detail": "p=2: " + traceback.format_exc()}
    if max(fwd, params) > tol:
        return {"outcome": "mismatch", "gap": max(fwd, params),
                "detail": f"p=2 t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
    return result | {"pipeline": "exact"}


def _everyone(flag: bool) -> bool:
    """flag on every rank (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_one(source: str, world: int = 2, timeout_s: float = 120.0) -> dict:
    """Check one model on `world` threaded ranks; the worst rank's outcome.

    A float32 mismatch is arbitrated in float64: a model can amplify rounding (a chain of unnormalized products)
    until reordering a sum moves its float32 numbers by more than 1e-5, which says nothing about the rewrite. In
    float64 the same rewrite must agree to 1e-10, and the float32 gap must be within 10x of the unmodified model's
    own float32 error (its float32 run against its float64 run); only then is the outcome "exact" (counted as
    "float64 arbiter"). A model so ill-conditioned that its own float32 error is large (outputs of 1e7 through a
    sine) amplifies float64 rounding too: its float64 gap may then reach 100x that error scaled by the ratio of the
    two machine epsilons (what rounding predicts), never more. A wrong rewrite is off by the same amount in
    either precision, far above both bounds."""
    try:
        built = build_model(source)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    result = _on_ranks(built, world, timeout_s)
    if result["outcome"] != "mismatch":
        return result
    model, *inputs = built
    wide_built = (copy.deepcopy(model).double(), *map(_double, inputs))
    own = _own_rounding(built, wide_built)
    wide = _on_ranks(wide_built, world, timeout_s)
    if wide["outcome"] == "exact" and result["gap"] <= 10 * own or wide["outcome"] == "mismatch" and \
            result["gap"] <= 10 * own and wide["gap"] <= 100 * own * _EPS_RATIO:
        return wide | {"outcome": "exact", "arbiter": f"float32 {result['detail']}; the unmodified model's own float32 error (against "
                                  f"float64) {own:.3g}; float64 {wide['detail']}"}
    return wide if wide["outcome"] not in ("refused", "exact") else result


_EPS_RATIO = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps


def _own_rounding(built, wide_built) -> float:
    """How far the unmodified model's float32 forward and SGD step land from its float64 ones."""
    (model, *_, args, kwargs), (wide, *_, wargs, wkwargs) = copy.deepcopy(built), copy.deepcopy(wide_built)
    got, want = model(*args, **kwargs), wide(*wargs, **wkwargs)
    forward = max(_gap(g.double(), w) for g, w in zip(_flat(got), _flat(want)))
    params = _sgd_gap(list(model.parameters()), lambda: {k: v.double() for k, v in model.state_dict().items()}, wide,
                      got, want)
    return max(forward, params)


def _double(tree):
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def _on_ranks(built, world: int, timeout_s: float) -> dict:
    """check() on `world` threaded ranks, each on its own copy of built = (model, args, kwargs, call_args,
    call_kwargs); the worst rank's."""
    import fxpar
    from fxpar.trace import trace

    copies = [copy.deepcopy(built) for _ in range(world)]
    try:
        traced = trace(*built[:3])
    except Exception as e:
        reason = _refusal(e)
        return {"outcome": "refused", "reason": reason} if reason else \
            {"outcome": "crash", "detail": traceback.format_exc()}
    try:
        results = on_ranks(lambda r: check(*copies[r], fxpar.init_mesh(tp=world), traced), world, timeout_s)
    except RankHang as e:
        return {"outcome": "hang", "detail": str(e)}
    results = [r if isinstance(r, dict) else {"outcome": "crash", "detail": r[1]} for r in results.values()]
    order = ["crash", "hang", "invalid", "mismatch", "refused", "exact"]
    return min(results, key=lambda r: order.index(r["outcome"]))


def fuzz(seeds, out_dir: str | None = None) -> dict:
    """The summary over the seeds: outcome counts, refusal reasons, failures as (seed, result), and the seeds whose
    float32 gap was arbitrated in float64."""
    counts, reasons, failures, arbitrated = Counter(), Counter(), [], []
    with Threaded():
        for seed in seeds:
            source = generate(seed)
            result = run_one(source)
            counts[result["outcome"]] += 1
            if result["outcome"] == "exact":
                counts["exact, sharded" if result.get("sharded") else "exact, replicated"] += 1
                if result.get("blocks"):
                    counts["exact, sequence blocks"] += 1
                if "arbiter" in result:
                    counts["exact, float64 arbiter"] += 1
                    arbitrated.append(seed)
                if "pipeline" in result:
                    counts[f"p=2 chained: {result['pipeline']}"] += 1
                if result.get("pipeline") == "refused":
                    reasons[f"p=2 chained, {result['pipeline_reason']}"] += 1
            if result["outcome"] == "refused":
                reasons[result["reason"]] += 1
            if result["outcome"] in BAD:
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
                   str(bounds[j + 1] - bounds[j]), "--json", os.path.join(tmp, f"{j}.json"), "--quiet"]
            cmd += ["--sequence-parallel"] if OPTIONS.get("sequence_parallel") else []
            cmd += ["--joint-graph"] if OPTIONS.get("joint_graph") else []
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


def save(out_dir: str, seed: int, source: str, result: dict) -> str:
    """Write a standalone reproduction: the model's source, the outcome, and a driver that reruns the check."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"fuzz_{seed}.py")
    detail = "\n".join(f"# {line}" for line in result.get("detail", "").splitlines())
    driver = (f'\n\nif __name__ == "__main__":  # python {path}\n    import sys\n    sys.path.insert(0, {ROOT!r})\n'
              f"    from tests.fuzz import OPTIONS, Threaded, run_one\n    OPTIONS.update({OPTIONS!r})\n"
              "    with Threaded():\n"
              "        print(run_one(open(__file__).read()))\n")
    with open(path, "w") as f:
        f.write(f"# fxpar fuzz seed {seed}: {result['outcome']}\n{detail}\n{source}{driver}")
    return path


def report(summary: dict, count: int, start: int, seconds: float) -> str:
    lines = [f"{count} models (seeds {start}..{start + count - 1}) in {seconds:.0f} s"]
    lines += [f"  {key}: {n}" for key, n in sorted(summary["counts"].items())]
    lines += [f"  refused, {reason}: {n}" for reason, n in summary["reasons"].most_common()]
    if summary["arbitrated"]:
        lines.append(f"  float64 arbiter on seeds {sorted(summary['arbitrated'])}")
    lines += [f"FAIL seed {seed}: {result['outcome']}: {result.get('detail', '').splitlines()[-1:]}"
              for seed, result in summary["failures"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fxpar's differential fuzzer (see tests/fuzz.py)")
    p.add_argument("--count", type=int, default=300, help="models to generate")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--jobs", type=int, default=1, help="processes (one core each)")
    p.add_argument("--out", default="fuzz-failures", help="folder for the failing models' reproductions")
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.add_argument("--sequence-parallel", action="store_true", help="build every model with Config(sequence_parallel)")
    p.add_argument("--joint-graph", action="store_true", help="build every model with Config(joint_graph)")
    args = p.parse_args(argv)
    if args.sequence_parallel:
        OPTIONS["sequence_parallel"] = True
    if args.joint_graph:
        OPTIONS["joint_graph"] = True
    start = time.perf_counter()
    summary = fuzz_jobs(args.start, args.count, args.jobs, args.out)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(summary, f)
    if not args.quiet:
        print(report(summary, args.count, args.start, time.perf_counter() - start))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
