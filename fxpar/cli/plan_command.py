"""`fxpar plan` (predict or search (p, t, d, b, v) for a GPT) and `fxpar calibrate` (measure this machine).

    fxpar plan --layers 96 --hidden 12288 --heads 96 --batch 1536 --gpus 1024 --cluster selene
    fxpar plan examples/gpt3_175b.py:factory --batch 1536 --gpus 1024 --tokens 300e9
    fxpar plan ... --tp 8 --pp 16 --json          # estimate that (t, p); b and v chosen unless given
    fxpar plan --layers 32 --hidden 4096 --heads 32 --experts 8 --top-k 2 --expert-ffn 14336 ...  # ep searched
    fxpar calibrate [--world 2] [--out ~/.cache/fxpar/local.json]  # then: fxpar plan ... --cluster local

Glossary: t tensor-, p pipeline-, d data-parallel degree; b microbatch; v chunks per device (interleaved).
The model behind the numbers is in fxpar.cost (module docstrings list every formula and overlap assumption).
"""
from __future__ import annotations

import argparse
import json
import sys

from tabulate import tabulate

from fxpar.cli.config_flags import add_config_flags, config_overrides
from fxpar.config import Config
from fxpar.cost.cluster import DEFAULT_LOCAL_PATH, GIB, get_cluster
from fxpar.cost.flops import RECOMPUTE_MODES, flops_per_iteration, parameters, training_days
from fxpar.cost.memory import PRECISIONS
from fxpar.cost.planner import PlanResult, SearchSpace, plan
from fxpar.cost.shape import ModelShape

SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "vocab", "ffn")
# the Config fields the search reads, and its defaults: v searched, recompute searched, the paper's plain optimizer
# and no sequence parallelism (as in the PTD-P paper), scatter/gather on (the pipeline crosses nodes, tp stays on one)
SEARCHED = {"virtual_stages": "auto", "recompute": "auto", "zero": 0, "sequence_parallel": False,
            "scatter_gather": True}
PAPER_DEFAULTS = {"seq": 2048, "vocab": 51200}


def add_parser(subparsers) -> None:
    """Register `plan` and `calibrate` on the `fxpar` subparsers."""
    p = subparsers.add_parser("plan", help="predict or search the (p, t, d, b, v) of a GPT on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", help="path/file.py:factory or module:factory, traced on the meta device")
    for flag in SHAPE_FLAGS:
        p.add_argument(f"--{flag}", type=int, help=f"model {flag} (overrides the traced value)")
    p.add_argument("--experts", type=int, default=0, help="routed experts E per layer: a mixture of experts (gated "
                                                           "MLPs; default 0: dense)")
    p.add_argument("--top-k", type=int, default=0, help="experts per token k (with --experts)")
    p.add_argument("--expert-ffn", type=int, default=0, help="each expert's hidden size f_e (default: --ffn)")
    p.add_argument("--batch", type=int, required=True, help="global batch B, in sequences")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs n = t p d")
    p.add_argument("--cluster", default="selene", help="selene | dgx2h | h100 | local | PATH.json")
    for flag, what in (("tp", "tensor-parallel t"), ("pp", "pipeline-parallel p"), ("microbatch", "microbatch b"),
                       ("ep", "expert-parallel ranks among the d (a model with --experts)")):
        p.add_argument(f"--{flag}", type=int, default=0, help=f"pin {what} (default: search)")
    p.add_argument("--max-tp", type=int, default=0, help="largest t searched (default: GPUs per node)")
    p.add_argument("--no-paper-rule", action="store_true", help="do not force t = GPUs per node for big models")
    p.add_argument("--precision", choices=PRECISIONS, default="",
                   help="model-state accounting: fxpar's bf16/fp16 (fp32 main grads), fp32, or the paper's fp16 "
                        "recipe (default: paper on 2-byte clusters, fp32 on 4-byte ones)")
    # the Config fields: the searched ones take auto; the rest go into the printed config (--json "fxpar")
    add_config_flags(p, owned=("microbatches", "schedule", "mixed_precision"), auto=tuple(SEARCHED),
                     defaults=SEARCHED)
    p.add_argument("--tokens", type=float, help="training tokens: add the Eq. 4 training-time estimate")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the best configuration as one JSON object")
    p.set_defaults(func=run_plan)

    c = subparsers.add_parser("calibrate", help="measure this machine as a node of --world busy devices: GEMM rate, "
                                                    "layer fit, gloo latency/bandwidth, sync jitter")
    c.add_argument("--out", default=str(DEFAULT_LOCAL_PATH), help=f"JSON to write (default {DEFAULT_LOCAL_PATH})")
    c.add_argument("--world", type=int, default=2, help="processes (devices) per node (default 2)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (for tests)")
    c.set_defaults(func=run_calibrate)


def build_shape(args) -> ModelShape:
    """ModelShape from TARGET (traced on meta) and/or the shape flags; flags win."""
    values = {}
    if args.target:
        from fxpar.cli.model_shape import shape_from_target  # imports torch.export only when needed
        traced = shape_from_target(args.target, args.batch)
        values = {"layers": traced.layers, "hidden": traced.hidden, "heads": traced.heads, "seq": traced.seq,
                  "vocab": traced.vocab, "ffn": traced.ffn_hidden}
    for flag in SHAPE_FLAGS:
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    missing = [f"--{flag}" for flag in ("layers", "hidden", "heads") if flag not in values]
    if missing:
        raise ValueError(f"give a TARGET or {', '.join(missing)} (--seq and --vocab default to 2048 and 51200)")
    for flag, default in PAPER_DEFAULTS.items():
        values.setdefault(flag, default)
    return ModelShape(layers=values["layers"], hidden=values["hidden"], heads=values["heads"], seq=values["seq"],
                      vocab=values["vocab"], batch=args.batch, ffn_hidden=values.get("ffn") or 0,
                      experts=args.experts, top_k=args.top_k, expert_ffn=args.expert_ffn)


def run_plan(args) -> int:
    """Handler of `fxpar plan`: 0 on success, 2 with a one-line error on bad input."""
    try:
        shape = build_shape(args)
        cluster = get_cluster(args.cluster)
        given = {**SEARCHED, **config_overrides(args)}
        searched = {k: given.pop(k) for k in SEARCHED}
        Config(**{k: v for k, v in {**searched, **given}.items() if v != "auto"})  # a bad value: its error, here
        space = SearchSpace(tp=args.tp, pp=args.pp, microbatch=args.microbatch, max_tp=args.max_tp, ep=args.ep,
                            paper_rule=not args.no_paper_rule, precision=args.precision, **_space(searched))
        result = plan(shape, args.gpus, cluster, space)
    except ValueError as e:
        print(f"fxpar plan: error: {e}", file=sys.stderr)
        return 2
    days = None
    if args.tokens:
        days = training_days(args.tokens, parameters(shape), args.gpus, eq4_flops_per_gpu(result))
    if args.json:
        print(json.dumps(plan_json(result, days, given)))
    else:
        print(format_plan(result, args.top, args.tokens, days))
    return 0


def eq4_flops_per_gpu(result: PlanResult) -> float:
    """X for Eq. 4. Its 8 T P counts 4 passes (full recomputation), so X is Eq. 3's full-recomputation FLOPs
    over the predicted iteration time, whatever recomputation the plan does: then 8 T P / (n X) is close to
    (T / (B s)) iterations x seconds per iteration (Eq. 4 drops the attention and logit terms)."""
    best = result.best
    return flops_per_iteration(result.shape, "full") / (best.seconds * best.config.gpus)


def _space(searched: dict) -> dict:
    """SearchSpace's fields from the searched Config flags (auto: every setting)."""
    v, recompute, zero, sp, sg = (searched[k] for k in SEARCHED)
    return {"vpp": 0 if v == "auto" else v, "recompute": RECOMPUTE_MODES if recompute == "auto" else (recompute,),
            "zero": (0, 1) if zero == "auto" else (zero,), "scatter_gather": sg is not False,
            "sequence_parallel": (False, True) if sp == "auto" else (sp,)}


def plan_json(result: PlanResult, days: float | None, config: dict | None = None) -> dict:
    """The best estimate's dict plus the shape, parameter count, candidate counts and Eq. 4 days."""
    out = result.best.as_dict()
    shape = result.shape
    out.update(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=shape.vocab,
               batch=shape.batch, ffn_hidden=shape.ffn_hidden, experts=shape.experts, top_k=shape.top_k,
               expert_ffn=shape.expert_ffn, params=parameters(shape),
               candidates=len(result.ranked), rejected={k: v[0] for k, v in result.rejected.items()})
    if days is not None:
        out["training_days"] = days
    out["fxpar"] = fxpar_config(result.best)
    out["fxpar"]["config"].update(config or {})  # the Config flags the search does not read, as given
    return out


MIXED_PRECISION = {"bf16": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "loss_scale": None},
                   "fp16": {"param_dtype": "float16", "reduce_dtype": "float32", "loss_scale": "dynamic"}}
MIXED_PRECISION["paper"] = MIXED_PRECISION["fp16"]


def fxpar_config(best) -> dict:
    """What runs the plan: `fxpar.init_mesh(**out["mesh"])` and `fxpar.Config.from_dict(out["config"])`, each
    `pm.step` given the global batch (`batch` sequences, cut into dp x microbatches of `microbatch`)."""
    c, precision = best.config, best.precision
    config = {"microbatches": best.microbatches, "virtual_stages": c.vpp, "schedule": c.schedule,
              "scatter_gather": c.scatter_gather, "recompute": c.recompute, "zero": c.zero,
              "sequence_parallel": c.sequence_parallel, "mixed_precision": MIXED_PRECISION.get(precision)}
    mesh = {"tp": c.tp, "pp": c.pp, "dp": c.dp} | ({"ep": c.ep} if c.ep > 1 else {})
    out = {"mesh": mesh, "config": config, "batch": best.shape.batch,
           "microbatch": c.microbatch}
    if precision == "paper":
        out["note"] = ("memory counted with the paper's fp16 gradients (20 B/param); fxpar's fp16 keeps fp32 main "
                       "gradients (18 B/param): plan with --precision fp16 to count those")
    return out


def format_plan(result: PlanResult, top: int, tokens: float | None, days: float | None) -> str:
    """Header, the table of the `top` fastest configurations, notes, rejection counts, Eq. 4 estimate."""
    shape = result.shape
    params = parameters(shape)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    lines = [f"{shape.describe()}  P={size}  on {result.gpus} GPUs of {result.cluster}"]
    rows = [[e.config.tp, e.config.pp, e.config.dp, e.config.microbatch, e.config.vpp, e.config.schedule,
             e.config.recompute, f"{e.seconds:.4g}", f"{e.tflops_per_gpu:.4g}", f"{e.percent_of_peak:.1f}",
             f"{e.memory.gib:.1f}", f"{e.bubble:.3f}"] for e in result.ranked[:top]]
    headers = ["t", "p", "d", "b", "v", "schedule", "recompute", "s/iter", "TFLOP/s/GPU", "% peak", "GiB/GPU",
               "bubble"]
    if any(e.config.sequence_parallel for e in result.ranked):  # a column only where it was searched or asked for
        headers.insert(7, "seq-par")
        for row, e in zip(rows, result.ranked):
            row.insert(7, "on" if e.config.sequence_parallel else "off")
    if shape.moe:  # expert parallelism: a column for a model with experts
        headers.insert(3, "ep")
        for row, e in zip(rows, result.ranked):
            row.insert(3, e.config.ep)
    lines.append(tabulate(rows, headers=headers, tablefmt="simple"))
    lines.append(f"{len(result.ranked)} configurations fit; TFLOP/s counts Eq. 3 with the recomputation done "
                 f"(72 B s l h^2 (...) without, 96 B s l h^2 (...) with full recomputation)")
    lines.extend(f"note: {note}" for note in result.notes)
    if result.rejected:
        lines.append("rejected:")
        lines.extend(f"  {reason}: {count} (e.g. {example})" for reason, (count, example) in result.rejected.items())
    if days is not None:
        lines.append(f"training {tokens:.3g} tokens: {days:.1f} days (Eq. 4: 8 T P / (n X), X = "
                     f"{eq4_flops_per_gpu(result) / 1e12:.1f} TFLOP/s per GPU counted with full recomputation)")
    return "\n".join(lines)


def run_calibrate(args) -> int:
    """Handler of `fxpar calibrate`: measure, fit, write the JSON, print a summary."""
    from fxpar.cli.calibrate import calibrate
    from fxpar.cost.cluster import save_cluster

    try:
        cluster, layer_error, raw = calibrate(world=args.world, threads=args.threads, quick=args.quick)
    except ValueError as e:
        print(f"fxpar calibrate: error: {e}", file=sys.stderr)
        return 2
    path = save_cluster(cluster, args.out)
    measured = path.with_name(path.stem + ".measurements.json")
    measured.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {path}: GEMM peak {cluster.peak_flops / 1e9:.1f} GFLOP/s, {cluster.gemm_efficiency:.2f} of it in a "
          f"Transformer layer, op overhead {cluster.kernel_overhead * 1e6:.1f} us (layer fit rms error "
          f"{layer_error * 100:.1f}%), memory {cluster.memory_bandwidth / 1e9:.1f} GB/s, gloo latency "
          f"{cluster.intra_latency * 1e6:.0f} us per ring step, bandwidth {cluster.intra_bandwidth / 1e9:.2f} GB/s, "
          f"sync jitter {cluster.sync_jitter * 100:.1f}% of compute, {cluster.memory_bytes / GIB:.1f} GiB per process; "
          f"the measurements behind it: {measured}")
    return 0
