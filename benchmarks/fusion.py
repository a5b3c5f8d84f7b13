"""Benchmark: the fusion and recompute passes on one train step of the example GPT (explicit attention), CPU, 1 thread.

    unfused            the traced graph as the tensor-parallel pass leaves it (t=1 here)
    fused              + fusion_pass (the default Config): explicit attention -> SDPA, identity dropouts removed,
                       bias+dropout+add where dropout draws, GeLU written out -> aten.gelu
    unfused/selective  unfused + recompute_pass("selective"): the attention core is recomputed in backward
    unfused/full       unfused + recompute_pass("full"): each layer's forward is recomputed in backward
    fused/selective, fused/full   the same on the fused graph (selective: with bias+GeLU recomputed, as
                       Config(recompute="selective") fuses it)

Before timing, every variant's loss and gradients are checked against unfused (fused: within 1e-5; recompute alone:
bit-equal). Then the variants run interleaved (rotated order each round, so none always goes first) for R rounds of
S steps; a sample is one round's mean step time; the table shows the median sample, and each ratio as the median over
rounds of the within-round ratio (drifting load from other processes mostly cancels); CPU ms (time.process_time) is
the steadier number when other processes load the machine. Recompute cost is reported as (CPU time of a step with
recompute - without) / forward time of the same graph: about 1 means one extra forward, as expected.
Saved activation bytes per layer (forward, weights excluded) are printed next to Korthikanti et al.'s formula, whose
16-bit count is doubled for fp32 (its 1-byte dropout masks are absent here: dropout is 0 in the example GPT).

Run:
    .venv/bin/python benchmarks/fusion.py                  # the example GPT's sizes (4 layers, hidden 64, 4 heads)
    .venv/bin/python benchmarks/fusion.py --hidden 256     # GEMMs weigh more: less to gain from attention
    .venv/bin/python benchmarks/fusion.py --attention in_graph   # the causal mask built in forward, folded
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.fx as fx
import torch.nn.functional as F

if __package__:  # imported as benchmarks.fusion (the tests)
    from benchmarks import common
else:  # run as a script: benchmarks/ is sys.path[0]
    import common

from gpt import GPT, GPTConfig  # noqa: E402

from fxpar.api import build  # noqa: E402
from fxpar.config import Config  # noqa: E402
from fxpar.cost.memory import activation_bytes_per_layer  # noqa: E402
from fxpar.cost.shape import ModelShape  # noqa: E402
from fxpar.runtime.measure import saved_activation_bytes  # noqa: E402
from fxpar.passes.fusion.driver import fusion_pass  # noqa: E402
from fxpar.passes.tensor_parallel.collectives import TPComm  # noqa: E402
from fxpar.passes.fusion.recompute import recompute_pass  # noqa: E402

VARIANTS = ("unfused", "fused", "unfused/selective", "unfused/full", "fused/selective", "fused/full")
TOL = 1e-5


def graphs(pm, values) -> dict[str, fx.GraphModule]:
    """Every variant's graph over the same parameters (the unfused one is pm's own)."""
    ref = pm.compiled.callables[0]
    fused = fusion_pass(fx.GraphModule(ref, copy.deepcopy(ref.graph)), values)
    out = {"unfused": ref, "fused": fused}
    for base in ("unfused", "fused"):
        for mode in ("selective", "full"):
            g = out[base]
            if base == "fused" and mode == "selective":  # as Config(recompute="selective"): the GeLU recomputed too
                g = fusion_pass(fx.GraphModule(ref, copy.deepcopy(ref.graph)), values, recompute_gelu=True)
            out[f"{base}/{mode}"] = recompute_pass(fx.GraphModule(g, copy.deepcopy(g.graph)), mode)
    return out


def _forward(pm, ids):
    return F.cross_entropy(pm(ids).flatten(0, 1), ids.flatten())


def _step(pm, ids, lr: float = 1e-4):
    for p in pm.parameters():
        p.grad = None
    loss = _forward(pm, ids)
    loss.backward()
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(p.grad, alpha=-lr)
    return loss


def check(pm, ids, gms) -> dict[str, tuple[float, float]]:
    """(loss rel error, max grad abs error) of every variant against its base, before any timing."""
    results, ref = {}, {}
    for name, gm in gms.items():
        pm.compiled.callables[0] = gm
        for p in pm.parameters():
            p.grad = None
        loss = _forward(pm, ids)
        loss.backward()
        ref[name] = (loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()})
    for name in gms:
        base = "unfused" if name in ("unfused", "fused") else name.split("/")[0]
        (l0, g0), (l1, g1) = ref[base], ref[name]
        results[name] = (((l1 - l0).abs() / l0.abs()).item(), max((g1[k] - g0[k]).abs().max().item() for k in g0))
        if "/" in name:  # recompute alone: bit-equal
            assert torch.equal(l0, l1) and all(torch.equal(g0[k], g1[k]) for k in g0), f"{name} is not bit-exact"
    return results


def saved_per_layer(cfg: GPTConfig, batch: int) -> dict[str, float]:
    """Saved activation bytes per layer = saved(L + 1 layers) - saved(L layers), for every variant."""
    per = {}
    for layers in (2, 3):
        pm, ids, values = make(GPTConfig(**{**cfg.__dict__, "layers": layers}), batch)
        for name, gm in graphs(pm, values).items():
            pm.compiled.callables[0] = gm
            _, saved = saved_activation_bytes(lambda: _forward(pm, ids), list(pm.parameters()) + list(pm.buffers()))
            per[name] = saved - per.get(name, 0)
    return per


def make(cfg: GPTConfig, batch: int):
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    pm = build(model, TPComm(0, 1), (ids,), config=Config(fuse=False))  # the unfused graph; variants from it
    return pm, ids, pm.compiled.traced.values(dict(model.named_buffers()))


def time_variants(pm, ids, gms, rounds: int, steps: int, warmup: int) -> dict:
    """Per variant and round: mean wall and CPU (process_time) seconds per step, and, right after the variant's steps
    of the round, one forward's wall time."""
    forward = {name: [] for name in gms}

    def step_of(gm):
        def step():
            pm.compiled.callables[0] = gm
            _step(pm, ids)
        return step

    def time_forward(name):  # pm still holds the graph of `name`
        start = time.perf_counter()
        with torch.no_grad():
            _forward(pm, ids)
        forward[name].append(time.perf_counter() - start)

    timed = common.time_rounds({name: step_of(gm) for name, gm in gms.items()}, rounds, steps, warmup,
                               after=time_forward)
    return {"times": timed["times"], "cpu": timed["cpu"], "forward": forward}


def _speedup(samples: dict, name: str) -> tuple[float, float, float]:
    """Median and quartiles over rounds of unfused/name within each round (> 1: name is faster)."""
    return common.paired_ratio(samples, "unfused", name, method="exclusive")


def format_table(result: dict) -> str:
    c = result["config"]
    mask = "mask built in forward" if c["attention"] == "in_graph" else "mask in a buffer"
    lines = [f"example GPT, explicit attention ({mask}): seq {c['seq']}, layers {c['layers']}, "
             f"hidden {c['hidden']}, heads {c['heads']}, batch {c['batch']}, 1 thread; {c['rounds']} rounds x "
             f"{c['steps']} steps",
             f"{'variant':<18} {'median ms':>9} {'CPU ms':>7} {'fwd ms':>7} {'speedup':>8} {'(q1-q3)':>12} "
             f"{'CPU speedup':>11} {'recompute/fwd':>13} {'loss rel err':>12} {'grad abs err':>12}"]
    for name in result["times"]:
        med, cpu_ms = (statistics.median(result[k][name]) * 1e3 for k in ("times", "cpu"))
        fwd = statistics.median(result["forward"][name]) * 1e3
        ratio, q1, q3 = _speedup(result["times"], name)
        cpu_ratio = _speedup(result["cpu"], name)[0]
        extra = ""
        if "/" in name:  # the extra step time over its base, in forwards
            extra = f"{(cpu_ms - statistics.median(result['cpu'][name.split('/')[0]]) * 1e3) / fwd:.2f}"
        loss_err, grad_err = result["errors"][name]
        lines.append(f"{name:<18} {med:>9.1f} {cpu_ms:>7.1f} {fwd:>7.1f} {ratio:>7.2f}x {f'({q1:.2f}-{q3:.2f})':>12} "
                     f"{cpu_ratio:>10.2f}x {extra:>13} {loss_err:>12.1e} {grad_err:>12.1e}")
    if "saved" in result:
        s, b, h, a = c["seq"], c["batch"], c["hidden"], c["heads"]
        lines += ["", "saved activation bytes per layer (fp32) vs Korthikanti et al. (16-bit count x 2)",
                  f"{'variant':<18} {'measured':>12} {'formula x2':>12} {'ratio':>6}"]
        for name, saved in result["saved"].items():
            mode = name.split("/")[1] if "/" in name else "none"
            shape = ModelShape(layers=c["layers"], hidden=h, heads=a, seq=s, vocab=c["vocab"])
            formula = 2 * activation_bytes_per_layer(shape, b, 1, mode)
            lines.append(f"{name:<18} {saved:>12.0f} {formula:>12.0f} {saved / formula:>6.2f}")
    return "\n".join(lines)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--attention", default="explicit", choices=["explicit", "in_graph"],
                   help="the causal mask held in a buffer, or built in forward")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds; the table shows medians over them")
    p.add_argument("--steps", type=int, default=2, help="train steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument("--no-memory", action="store_true", help="skip the saved-bytes table")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention=args.attention)
    pm, ids, values = make(cfg, args.batch)
    gms = graphs(pm, values)
    errors = check(pm, ids, gms)
    for name, (loss_err, grad_err) in errors.items():
        assert loss_err <= TOL and grad_err <= TOL, f"{name}: loss rel {loss_err:.1e}, grad abs {grad_err:.1e}"
    result = time_variants(pm, ids, gms, args.rounds, args.steps, args.warmup)
    result["errors"] = errors
    result["config"] = vars(args)
    if not args.no_memory:
        result["saved"] = saved_per_layer(cfg, args.batch)
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
