"""`fxpar check TARGET --tp T [--pp P --dp D ...]`: is the model, under this plan, exactly the model you wrote?

Trains the parallel model for --steps optimizer steps (AdamW) beside the unmodified model on one process, on the
same batches, on this machine's CPU (fxpar/check.py: the ranks are local processes over gloo, no torchrun). Prints
each step's two losses and the largest parameter difference, then the communication ledger: every layer's
collectives, each under the pass that runs it, against Megatron's (2 all-reduces forward and 2 backward; with
sequence parallelism 2 all-gathers and 2 reduce-scatters forward, their conjugates and 2 all-gathers of the saved
blocks backward: 4 + 6), with the plan's reason for any layer above.

TARGET is path/file.py:factory or module:factory; factory() returns (model, example_args[, example_kwargs[,
loss]]), loss(output, *args, **kwargs) -> the scalar loss of one microbatch, given its inputs too (default:
output.loss where the model has one, as a Hugging Face model given labels=, else the mean square of the first
output).

Exit status: 0 exact (fp32: within 1e-5 relative, a larger gap arbitrated in float64; bf16: losses within 2e-3 of the
one-process bf16 recipe, and the plan exact in fp32), 1 a mismatch (the first step and parameter that differ), 2
refused by fxpar (its message), 3 fxpar failed (a bug: the traceback).
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import Counter

from tabulate import tabulate

from fxpar.cli.config_flags import add_config_flags, config_overrides

EXIT = {"exact": 0, "mismatch": 1, "refused": 2, "failed": 3}


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="prove the parallel model exact against the unmodified one, on CPU",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="path/file.py:factory or module:factory")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree t (default 2)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages p (default 1)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas d (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks among the d (default 1: every rank "
                                                      "holds every expert)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 (default), or bf16: its losses against the one-process bf16 recipe, then the same "
                        "plan in fp32 (fxpar/check.py [Tolerance])")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps K (default 3)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the factory, and of the batches")
    add_config_flags(p, owned=("seed", "mixed_precision"),
                     defaults={"microbatches": "2 p v with a pipeline, else 1", "schedule": "the one for v"})
    p.set_defaults(func=run)


def ledger(result) -> str:
    """Every layer's collectives per step, each under the pass that runs it, next to Megatron's count for the layer's
    layout, with the plan's reason above it."""
    from fxpar.passes.sharding.comm_audit import MEGATRON, OUTSIDE

    per_step = result.spec.m * result.bytes_per_element

    def size(cs) -> str:
        total = sum(math.prod(c.shape) for c in cs) * per_step
        return f"{total / 2**10:.1f} KiB" if total else "-"

    def kinds(cs) -> str:
        return ", ".join(f"{n} {k}" for k, n in Counter(c.what for c in cs).items()) or "-"

    rows = []
    for c in result.ledger:
        megatron = "-" if c.layer == OUTSIDE else " + ".join(map(str, c.bound))
        mark = "ABOVE: " + c.note if c.above_bound else ""
        rows.append([c.layer, kinds(c.forward), size(c.forward), kinds(c.backward), size(c.backward),
                     kinds(c.small), size(c.small), megatron, mark])
    head = ["layer", "forward", "bytes/step", "backward", "bytes/step", "small", "bytes/step", "Megatron", ""]
    if not rows:
        return "(no collectives: t=1)"
    forward, backward = MEGATRON[True]
    legend = [] if not any(c.sequence for c in result.ledger) else [
        "Megatron with sequence parallelism (Korthikanti et al. 2022), per layer: forward "
        + ", ".join(f"{n} {op}" for op, n in forward.items()) + "; backward "
        + ", ".join(f"{n} {op}" for op, n in backward.items())
        + " (the conjugates, and the column-parallel GEMMs' saved blocks gathered again)"]
    return "\n".join([tabulate(rows, head), *legend])


def report(result) -> str:
    from fxpar.check import relative

    s = result.spec
    c = s.parallel_config()
    schedule = f" {c.schedule}" if s.pp > 1 else ""
    mesh = f"t={s.tp} p={s.pp} d={s.dp}" + (f" e={s.ep}" if s.ep > 1 else "")
    lines = [f"fxpar check {s.target}: {mesh} v={c.virtual_stages} m={c.microbatches}{schedule} "
             f"{s.precision}, {s.steps} AdamW steps (lr {s.lr:g}) on {s.world} local ranks over gloo"]
    if result.status in ("refused", "failed"):
        what = "refused by fxpar" if result.status == "refused" else "fxpar failed (a bug; please report it)"
        return "\n".join(lines + [f"{what}:", result.message])
    if result.low_steps:
        rows = [[i, f"{st.loss:.5f}", f"{st.reference:.5f}", f"{relative(st.loss, st.reference):.1e}"]
                for i, st in enumerate(result.low_steps)]
        lines += ["bf16 against the same recipe on one process (losses within 2e-3; parameters: the fp32 run below)",
                  tabulate(rows, ["step", "loss (fxpar)", "loss (model)", "relative gap"]), "",
                  "the same plan in fp32 (losses and every parameter within 1e-5)"]
    rows = [[i, f"{st.loss:.7f}", f"{st.reference:.7f}", f"{st.gap:.2e}", st.worst] for i, st in
            enumerate(result.steps)]
    lines.append(tabulate(rows, ["step", "loss (fxpar)", "loss (model)", "largest parameter difference", "where"]))
    worst = max((st.gap for st in result.steps), default=0.0)
    if result.status == "exact" and result.arbiter:
        lines.append(f"exact, by the float64 arbiter: {result.arbiter} (the steps above are the float64 run's)")
    elif result.status == "exact":
        lines.append(f"exact: {len(result.steps)} steps within {result.tolerance:g} (relative, fp32); "
                     f"largest parameter difference {worst:.2e}")
    else:
        lines.append(f"MISMATCH: {result.message}")
    lines += ["", "communication per layer, per step (bytes: this rank's values reduced or gathered, m microbatches)",
              ledger(result)]
    return "\n".join(lines)


def run(args) -> int:
    from fxpar.check import CheckSpec, check

    try:
        spec = CheckSpec(args.target, tp=args.tp, pp=args.pp, dp=args.dp, ep=args.ep, config=config_overrides(args),
                         precision=args.precision, steps=args.steps, lr=args.lr, seed=args.seed)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    result = check(spec)
    print(report(result), flush=True)
    return EXIT[result.status]
