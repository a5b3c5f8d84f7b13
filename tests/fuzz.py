"""The differential fuzzer: generated models (tests/fuzz_models.py) against fxpar at t=2, and p=2, t=2.

Each model runs on 2 tensor-parallel ranks, threads of one process on torch's threaded process group
(torch.testing._internal.distributed.multi_threaded_pg), real collectives and no fake of them. The outcome is:

    exact      forward and every parameter after one SGD step within 1e-5 of the unmodified model (relative to
               the values' size when they exceed 1); with two layers or more, also the model cut into p=2 chunks
               and run chunk after chunk (the boundaries fxpar chose), forward and SGD step
    refused    fxpar said clearly why it cannot (a ValueError or TraceError naming fxpar): allowed
    mismatch   numbers differ: never allowed
    crash      any other exception, from inside a pass or the runtime: never allowed
    hang       a rank did not finish within the timeout: never allowed
    invalid    the model itself fails (a generator bug): counted, must stay 0

    python -m tests.fuzz --count 5000 [--start 0] [--out fuzz-failures]   (`make fuzz N=...`)

prints the counts and writes each failing model as a standalone file (the model's source plus a driver that
reruns the check) into --out.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import threading
import time
import traceback
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.fuzz_models import generate, load  # noqa: E402

TOL = 1e-5
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


def _refusal(e: Exception) -> str | None:
    """The reason of a clear refusal, or None when the exception is not one."""
    from fxpar.trace import TraceError

    text = str(e)
    if isinstance(e, (ValueError, TraceError, TypeError)) and "fxpar" in text:
        return text.split("\n")[0].split(":")[1 if text.startswith("fxpar") else 0].strip()[:60]
    return None


def build_model(source: str):
    """(model, args, kwargs) of a generated source; build it in one thread (its weights come from the global
    generator, which threads share) and hand each rank a copy."""
    Model, example = load(source)
    torch.manual_seed(0)
    model = Model()
    args, kwargs = example()
    return model, args, kwargs


def check(model, args, kwargs, mesh) -> dict:
    """The outcome of one generated model on this rank (see the module docstring)."""
    import fxpar
    from fxpar.api import build
    from fxpar.executable import tp_comm

    reference, chain_model, chain_ref = (copy.deepcopy(model) for _ in range(3))
    try:
        want = reference(*args, **kwargs)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    config = fxpar.Config(seed=0)
    try:
        pm = fxpar.parallelize(model, mesh, example_args=args, example_kwargs=kwargs, config=config)
        got = pm(*args, **kwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(want)))
        params = _sgd_gap(list(pm.parameters()), pm.full_state_dict, reference, got, want)
        sharded = bool(pm.plan.sharded_regions)
    except Exception as e:
        reason = _refusal(e)
        return {"outcome": "refused", "reason": reason} if reason else \
            {"outcome": "crash", "detail": traceback.format_exc()}
    result = {"outcome": "exact" if max(fwd, params) <= TOL else "mismatch", "sharded": sharded,
              "detail": f"t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
    if not _everyone(result["outcome"] == "exact") or len(model.layers) < 2:
        return result  # every rank takes the same branch, or one would wait in a collective alone
    try:
        pp = build(chain_model, tp_comm(mesh), args, kwargs, config=config, pp=2)
        got = _chained(pp, args, kwargs)
        fwd = max(_gap(g, w) for g, w in zip(_flat(got), _flat(chain_ref(*args, **kwargs))))
        params = _sgd_gap(list(pp.parameters()), pp.full_state_dict, chain_ref, got, chain_ref(*args, **kwargs))
    except Exception as e:
        if _refusal(e):
            return result | {"pipeline": "refused"}
        return {"outcome": "crash", "detail": "p=2: " + traceback.format_exc()}
    if max(fwd, params) > TOL:
        return {"outcome": "mismatch", "detail": f"p=2 t=2: forward gap {fwd:.3g}, parameters after SGD {params:.3g}"}
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
    """Check one model on `world` threaded ranks; the worst rank's outcome."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    import fxpar

    store = dist.HashStore()
    results: dict[int, dict] = {}
    try:
        built = build_model(source)
    except Exception:
        return {"outcome": "invalid", "detail": traceback.format_exc()}
    copies = [copy.deepcopy(built) for _ in range(world)]

    def rank(r: int) -> None:
        try:
            dist.init_process_group("threaded", rank=r, world_size=world, store=store)
            torch.set_num_threads(1)
            results[r] = check(*copies[r], fxpar.init_mesh(tp=world))
        except BaseException:
            results[r] = {"outcome": "crash", "detail": traceback.format_exc()}
            ProcessLocalGroup.exception_handle(None)  # wake the other ranks from any collective
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        ProcessLocalGroup.exception_handle(None)
        return {"outcome": "hang", "detail": f"a rank did not finish within {timeout_s} s"}
    ProcessLocalGroup.reset()
    order = ["crash", "hang", "invalid", "mismatch", "refused", "exact"]
    return min(results.values(), key=lambda r: order.index(r["outcome"]))


class Threaded:
    """Installs torch's threaded process group for the duration (one process, ranks as threads)."""

    def __enter__(self):
        import torch._C._distributed_c10d as c10d
        from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

        c10d._set_thread_isolation_mode(True)
        _install_threaded_pg()
        return self

    def __exit__(self, *exc):
        import torch._C._distributed_c10d as c10d
        from torch.testing._internal.distributed.multi_threaded_pg import _uninstall_threaded_pg

        _uninstall_threaded_pg()
        c10d._set_thread_isolation_mode(False)


def fuzz(seeds, out_dir: str | None = None) -> tuple[Counter, Counter, list]:
    """(outcome counts, refusal reasons, failures as (seed, result)) over the seeds."""
    counts, reasons, failures = Counter(), Counter(), []
    with Threaded():
        for seed in seeds:
            source = generate(seed)
            result = run_one(source)
            counts[result["outcome"]] += 1
            if result["outcome"] == "exact":
                counts["exact, sharded" if result.get("sharded") else "exact, replicated"] += 1
                if "pipeline" in result:
                    counts[f"p=2 chained: {result['pipeline']}"] += 1
            if result["outcome"] == "refused":
                reasons[result["reason"]] += 1
            if result["outcome"] in BAD:
                failures.append((seed, result))
                if out_dir:
                    save(out_dir, seed, source, result)
    return counts, reasons, failures


def save(out_dir: str, seed: int, source: str, result: dict) -> str:
    """Write a standalone reproduction: the model's source, the outcome, and a driver that reruns the check."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"fuzz_{seed}.py")
    detail = "\n".join(f"# {line}" for line in result.get("detail", "").splitlines())
    driver = (f'\n\nif __name__ == "__main__":  # python {path}\n    import sys\n    sys.path.insert(0, {ROOT!r})\n'
              "    from tests.fuzz import Threaded, run_one\n    with Threaded():\n"
              "        print(run_one(open(__file__).read()))\n")
    with open(path, "w") as f:
        f.write(f"# fxpar fuzz seed {seed}: {result['outcome']}\n{detail}\n{source}{driver}")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fxpar's differential fuzzer (see tests/fuzz.py)")
    p.add_argument("--count", type=int, default=300, help="models to generate")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--out", default="fuzz-failures", help="folder for the failing models' reproductions")
    args = p.parse_args(argv)
    start = time.perf_counter()
    counts, reasons, failures = fuzz(range(args.start, args.start + args.count), args.out)
    print(f"{args.count} models (seeds {args.start}..{args.start + args.count - 1}) in "
          f"{time.perf_counter() - start:.0f} s")
    for key, n in sorted(counts.items()):
        print(f"  {key}: {n}")
    for reason, n in reasons.most_common():
        print(f"  refused, {reason}: {n}")
    for seed, result in failures:
        print(f"FAIL seed {seed}: {result['outcome']}: {result.get('detail', '').splitlines()[-1:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
