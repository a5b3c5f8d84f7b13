"""What the benchmarks share: their import path, the rotated-round timer, paired per-round ratios, and the launcher.

* Importing this module puts the benchmarks folder (megatron_gpt), the repository root (fxpar) and examples/ (gpt)
  on sys.path, so a benchmark imports them alike when it runs as a script and when the tests import it as
  `benchmarks.<name>`.
* `time_rounds` runs the variants of a benchmark interleaved, rotating their order each round so that none always
  runs first, and times wall and CPU seconds per step; on several ranks it combines the ranks' samples.
* `paired_ratio` is the median and quartiles over rounds of one variant's time over another's within each round:
  the two ran back to back, so load drifting on a shared machine mostly cancels.
* `launch(run, args)` calls `run(args)` on every rank inside a gloo process group: under torchrun when its
  environment is set, else on ranks spawned here (`spawn`: a FileStore in a temporary directory, never a fixed port;
  one thread per rank). Both return rank 0's result ({} on other torchrun ranks).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _put_on_path() -> None:
    """The benchmarks folder, the repository root and examples/ first on sys.path (each once)."""
    for path in (HERE, ROOT, os.path.join(ROOT, "examples")):
        if path not in sys.path:
            sys.path.insert(0, path)


_put_on_path()


# ---- timing ------------------------------------------------------------------------------------------------------

def time_rounds(step_fns: dict, rounds: int, steps: int = 1, warmup: int = 0, barrier: bool = False,
                reduce=None, reduce_cpu=None, after=None) -> dict:
    """Time every function of `step_fns` ({name: function doing one step}) interleaved, and return
    {"times": {name: [wall seconds per step, one per round]}, "cpu": {name: [CPU seconds per step, ...]}}.

    First `warmup` untimed calls of each function, in turn. Then `rounds` rounds; in round r the names run in the
    order `names[r % n:] + names[:r % n]` (rotated, so that none always runs first), each `steps` times in a row,
    timed with time.perf_counter (wall) and time.process_time (CPU: it leaves out the time spent waiting for a core
    or for another rank, so it is the steadier number on a loaded machine).
      barrier     a dist.barrier() before each name's steps, so that the ranks start them together;
      reduce      a dist.ReduceOp combining the ranks' wall samples at the end (MAX: a step is as slow as its
                  slowest rank); None on one process;
      reduce_cpu  the same for the CPU samples, `reduce` when None (SUM: the CPU work of all ranks together);
      after       called with the name after each name's timed steps, untimed (to time something else there).
    """
    names = list(step_fns)
    for _ in range(warmup):
        for fn in step_fns.values():
            fn()
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if barrier:
                dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step_fns[name]()
            times[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - start_cpu) / steps)
            if after is not None:
                after(name)
    if reduce is not None:
        times = _over_ranks(times, reduce)
        cpu = _over_ranks(cpu, reduce if reduce_cpu is None else reduce_cpu)
    return {"times": times, "cpu": cpu}


def sgd_step(params, run, lr: float = 1e-3):
    """A timed train step as a function of nothing: zero the gradients, run() (forward and backward), an SGD step."""
    opt = torch.optim.SGD(list(params), lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        run()
        opt.step()

    return step


def pm_step(pm, opt, *args, **kwargs):
    """A timed train step of an fxpar pipeline module as a function of nothing: pm.step(*args, **kwargs) (the global
    batch, target= among kwargs) and opt's step; it returns the loss."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss = pm.step(*args, **kwargs)
        opt.step()
        return loss.item()

    return step


def ratio_rows(times: dict, base: str, mib: dict) -> list[list]:
    """Per variant of `times`: name, median ms, the median per-round ratio against `base` and its IQR, and
    mib[name] bytes in MiB: the rows of a table of variants against one of them."""
    rows = []
    for name in times:
        ratio, q1, q3 = paired_ratio(times, name, base)
        rows.append([name, statistics.median(times[name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}", mib[name] / 2**20])
    return rows


def _over_ranks(samples: dict, op) -> dict:
    """{name: [samples]} combined elementwise over the ranks of the default group with the dist.ReduceOp `op`."""
    names = list(samples)
    sample = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    dist.all_reduce(sample, op=op)
    return {name: sample[i].tolist() for i, name in enumerate(names)}


def paired_ratio(samples: dict, name: str, base: str, method: str = "inclusive") -> tuple[float, float, float]:
    """(median, first quartile, third quartile) over rounds of samples[name] / samples[base] within each round: both
    ran in the same round, so load drift on the machine mostly cancels. `method` is statistics.quantiles'; with one
    round, all three are its ratio."""
    r = [a / b for a, b in zip(samples[name], samples[base])]
    q = statistics.quantiles(r, n=4, method=method) if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), q[0], q[2]


# ---- launching ranks ---------------------------------------------------------------------------------------------

def launch(run, args) -> dict:
    """run(args) on every rank: under torchrun when its environment is set, else on args.nproc ranks spawned here.
    run: a module-level function of args (it travels to spawned ranks by reference); args needs .nproc, .timeout.
    Returns rank 0's result ({} on other torchrun ranks)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        try:
            result = run(args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return result if int(os.environ["RANK"]) == 0 else {}
    return spawn(run, args, args.nproc, args.timeout)


def launch_and_print(run, args, format_table) -> dict:
    """launch(run, args), then print format_table(result) on rank 0; returns the result ({} on other ranks)."""
    result = launch(run, args)
    if result:
        print(format_table(result), flush=True)
    return result


def spawn(run, args, nproc: int, timeout: float):
    """run(args) on `nproc` ranks spawned here, one thread each, in a gloo group over a FileStore in a temporary
    directory (never a fixed port); returns rank 0's result. run: a module-level function, as for `launch`."""
    import torch.multiprocessing as mp

    with _one_thread_per_rank(), tempfile.TemporaryDirectory(prefix="fxpar-bench-") as store_dir:
        mp.spawn(_spawned, args=(run, args, nproc, timeout, store_dir), nprocs=nproc, join=True)
        with open(os.path.join(store_dir, "result.pkl"), "rb") as f:
            return pickle.load(f)


def _spawned(rank: int, run, args, nproc: int, timeout: float, store_dir: str) -> None:
    """One spawned rank: join the group, run, and leave rank 0's result in store_dir/result.pkl."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nproc, timeout=timedelta(seconds=timeout))
    try:
        result = run(args)
        if rank == 0:
            with open(os.path.join(store_dir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
        dist.barrier()  # no rank tears its gloo pairs down while a peer still uses them
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of torch's threads (it can abort: "terminate called without...")


@contextlib.contextmanager
def _one_thread_per_rank():
    """OMP_NUM_THREADS=MKL_NUM_THREADS=1 while inside (the spawned ranks inherit it), then as they were."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
