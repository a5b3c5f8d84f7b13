"""The fuzzer's command line (`python -m tests.fuzz ...`, `make fuzz`): its modes parsed into tests/fuzz.py's OPTIONS
and LOSS, the run, and the summary in lines. See tests/fuzz.py for what each outcome means."""
from __future__ import annotations

import argparse
import sys
import time

from tests.fuzz import LOSS, NOT_FUZZED, OPTIONS, _config, fuzz_jobs, mode_argv


def config_option(text: str) -> tuple[str, object]:
    """One --config KEY=VALUE: the value parsed as the type of fxpar.Config's field KEY, as fxpar's own Config flags
    parse it (fxpar/cli/config_flags.py parse_field: a bool true or false, None none, a tuple comma-separated)."""
    from fxpar.cli.config_flags import parse_field

    key, eq, value = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a field of fxpar.Config, got {text!r}")
    if key in NOT_FUZZED:
        raise argparse.ArgumentTypeError(f"{key} is not fuzzed: {NOT_FUZZED[key]}")
    try:
        return key, parse_field(key, value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def report(summary: dict, count: int, start: int, seconds: float, cpu: float | None = None) -> str:
    """The summary in lines; seconds: wall-clock, cpu: CPU seconds (what a loaded machine does not inflate)."""
    used = f"{seconds:.0f} s" + (f", {cpu:.0f} s CPU ({count / max(cpu, 1e-9):.2f} models per CPU second)"
                                 if cpu is not None else "")
    lines = [f"{count} models (seeds {start}..{start + count - 1}) in {used}"
             f"{' (' + ' '.join(mode_argv()) + ')' if mode_argv() else ''}"]
    lines += [f"  {key}: {n}" for key, n in sorted(summary["counts"].items())]
    lines += [f"  {reason}: {n}" for reason, n in summary["reasons"].most_common()]
    if summary["arbitrated"]:
        lines.append(f"  float64 arbiter on seeds {sorted(summary['arbitrated'])}")
    lines += [f"FAIL seed {seed}: {result['outcome']}: {result.get('detail', '').splitlines()[-1:]}"
              for seed, result in summary["failures"]]
    return "\n".join(lines)


def _cpu_seconds() -> float:
    """CPU seconds of this process (every rank thread) and of its finished job processes."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                         resource.RUSAGE_CHILDREN)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="fxpar's differential fuzzer (see tests/fuzz.py)")
    p.add_argument("--count", type=int, default=300, help="models to generate")
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--jobs", type=int, default=1, help="processes (one core each)")
    p.add_argument("--out", default="fuzz-failures", help="folder for the failing models' reproductions")
    p.add_argument("--json", help="also write the summary here")
    p.add_argument("--quiet", action="store_true", help="print nothing (with --json)")
    p.add_argument("--config", action="append", type=config_option, default=[], metavar="KEY=VALUE",
                   help="an fxpar.Config field for every build, parsed as its type (repeatable): recompute=selective, "
                        "fuse=false, joint_graph=true overlap=early_collectives,dp_buckets, microbatches=4 (--loss)")
    p.add_argument("--sequence-parallel", action="store_true", help="--config sequence_parallel=true")
    p.add_argument("--joint-graph", action="store_true", help="--config joint_graph=true")
    p.add_argument("--loss", action="store_true",
                   help="train with a token-mean cross-entropy through pm.step (uneven ignore_index masks) against "
                        "one process on the whole global batch")
    p.add_argument("--dp", type=int, default=2, help="with --loss: data-parallel degree (2 x dp threaded ranks)")
    p.add_argument("--ep", type=int, default=1,
                   help="with --loss: expert-parallel degree (divides dp); every model's MLPs are mixtures of experts")
    args = p.parse_args(argv)
    OPTIONS.update(args.config)
    if args.sequence_parallel:
        OPTIONS["sequence_parallel"] = True
    if args.joint_graph:
        OPTIONS["joint_graph"] = True
    if args.loss:
        LOSS["dp"] = args.dp
        if args.ep > 1:
            LOSS["ep"] = args.ep
    elif args.ep > 1:
        p.error("--ep trains the experts over ep of the dp ranks: use it with --loss")
    elif OPTIONS.get("microbatches", 1) > 1 or OPTIONS.get("zero") or "check_replicas_every" in OPTIONS:
        p.error("microbatches, zero and check_replicas_every act in pm.step: use them with --loss")
    try:
        _config()
    except ValueError as e:
        p.error(str(e))
    start, cpu = time.perf_counter(), _cpu_seconds()
    summary = fuzz_jobs(args.start, args.count, args.jobs, args.out)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(summary, f)
    if not args.quiet:
        print(report(summary, args.count, args.start, time.perf_counter() - start, _cpu_seconds() - cpu))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
