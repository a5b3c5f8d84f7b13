"""Ranks as threads of one process, on torch's threaded process group (real collectives, no fake of them).

    with Threaded():                                   # install the threaded backend for the duration
        results = on_ranks(fn, world=2, timeout_s=60)  # fn(rank) on every rank, each in its own thread

Used by the differential fuzzer (tests/fuzz.py) and the Hugging Face sweep (tests/hf_sweep.py), which run
thousands of small checks where starting gloo processes would cost more than the checks.
"""
from __future__ import annotations

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
