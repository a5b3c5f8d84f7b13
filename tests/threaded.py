"""Ranks as threads of one process, on torch's threaded process group (real collectives, no fake of them).

    with Threaded():                                   # install the threaded backend for the duration
        results = on_ranks(fn, world=2, timeout_s=60)  # fn(rank) on every rank, each in its own thread

Used by the differential fuzzer (tests/fuzz.py) and the Hugging Face sweep (tests/hf_sweep.py), which run
thousands of small checks where starting gloo processes would cost more than the checks.
"""
from __future__ import annotations

import copy
import threading
import time
import traceback

import torch


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


class RankHang(RuntimeError):
    """A rank did not finish within the timeout."""


def on_ranks(fn, world: int, timeout_s: float) -> dict:
    """{rank: fn(rank)} with every rank a thread in one threaded process group (inside `Threaded()`).

    A rank that raises records ("crash", traceback) as its result and wakes the others from any collective; a rank
    still running after timeout_s raises RankHang."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    store = dist.HashStore()
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            dist.init_process_group("threaded", rank=r, world_size=world, store=store)
            torch.set_num_threads(1)
            results[r] = fn(r)
        except BaseException:
            results[r] = ("crash", traceback.format_exc())
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
        raise RankHang(f"a rank did not finish within {timeout_s} s")
    ProcessLocalGroup.reset()
    return results


def parallelize_traced(model, traced, args: tuple, kwargs: dict | None = None, tp: int = 2, config=None):
    """fxpar.parallelize at tp, reusing a trace made once before the rank threads start (torch.export is not
    thread-safe: two ranks tracing at once can trip over each other's fake mode)."""
    import fxpar
    from fxpar.api import build
    from fxpar.mesh import tp_comm

    mesh = fxpar.init_mesh(tp=tp)
    return build(model, tp_comm(mesh), args, kwargs or {}, mesh, config=config, traced=traced)


def on_tp_ranks(model, args: tuple, per_rank, kwargs: dict | None = None, tp: int = 2, timeout_s: float = 60.0,
                config=None):
    """[per_rank(pm, reference) for every rank]: the model traced once, each rank parallelizing its own copy at tp
    (`reference` is an unmodified copy of it), inside one threaded process group. A rank that raised fails the
    caller with its traceback."""
    from fxpar.trace import trace

    traced = trace(model, args, kwargs or {})
    copies = [copy.deepcopy(model) for _ in range(tp)]

    def rank(r):
        reference = copy.deepcopy(copies[r])
        return per_rank(parallelize_traced(copies[r], traced, args, kwargs, tp, config), reference)

    with Threaded():
        results = on_ranks(rank, tp, timeout_s)
    for r, got in results.items():
        if isinstance(got, tuple) and len(got) == 2 and got[0] == "crash":
            raise AssertionError(f"rank {r} raised:\n{got[1]}")
    return [results[r] for r in range(tp)]
