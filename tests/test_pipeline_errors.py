"""Pipeline bad input gets a clear error; a rank that dies mid-step makes the others fail naming it, in time."""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch

from tests import models
from tests.harness import module_pool
from tests.test_pipeline_exact import loss_fn

pool2 = module_pool(2)


def _parallelize(name, p, t, d, v, schedule, m, loss=loss_fn):
    import fxpar

    model, args, kwargs = models.build(name)
    config = fxpar.Config(microbatches=m, virtual_stages=v, schedule=schedule)
    try:
        fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                          loss_fn=loss, config=config)
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


def _bad_batch():
    import fxpar

    model, args, kwargs = models.build("gpt8")
    pm = fxpar.parallelize(model, fxpar.init_mesh(pp=2), example_args=args, loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=4))
    ids = torch.zeros(6, args[0].shape[1], dtype=torch.long)
    try:
        pm.step(ids, target=ids)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("args,needle", [
    (("gpt8", 2, 1, 1, 2, "interleaved-1f1b", 3), "multiple of pp: m=3, p=2"),
    (("gpt", 2, 1, 1, 2, "interleaved-1f1b", 2), "cannot cut 2 layers into p*v = 4 chunks"),
    (("gpt8", 2, 1, 1, 1, "1f1b", 2, None), "pass loss_fn=fn"),
    (("gpt8", 2, 2, 1, 1, "1f1b", 2), "pp*dp*tp = 2*1*2 = 4, but the world size is 2"),
])
def test_bad_pipeline_input(pool2, args, needle):
    for msg in pool2.run(_parallelize, *args):
        assert needle in msg, msg


def test_batch_not_divisible_by_dp_times_m(pool2):
    for msg in pool2.run(_bad_batch):
        assert "global batch 6 is not divisible by dp*microbatches = 1*4 = 4" in msg


def _dying_rank(rank, path, queue):
    import torch.distributed as dist

    import fxpar

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    model, args, _ = models.build("gpt8")
    pm = fxpar.parallelize(model, fxpar.init_mesh(pp=2), example_args=args, loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=2))
    ids = torch.zeros(4, args[0].shape[1], dtype=torch.long)
    pm.step(ids, target=ids)
    if rank == 1:
        os._exit(7)  # dies between steps: stage 0's next send/receive has no peer
    start = time.time()
    try:
        pm.step(ids, target=ids)
        queue.put(("no error", time.time() - start))
    except Exception as e:  # noqa: BLE001 - we report whatever it raised
        queue.put((str(e), time.time() - start))


@pytest.mark.gloo
def test_dead_rank_is_named():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    path = tempfile.mktemp()
    procs = [ctx.Process(target=_dying_rank, args=(r, path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    msg, waited = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert "global rank 1" in msg and "stopped answering" in msg, msg
    assert waited < 25, waited  # within the process group's timeout


def _write_trace(trace_dir):
    import json

    import torch.distributed as dist

    import fxpar

    model, args, _ = models.build("gpt8")
    pm = fxpar.parallelize(model, fxpar.init_mesh(pp=2), example_args=args, loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=2, trace_dir=trace_dir))
    ids = torch.zeros(4, args[0].shape[1], dtype=torch.long)
    pm.step(ids, target=ids)
    assert "pipeline chunks" in str(pm.plan) and pm.plan.stages[1][:3] == (1, 1, (4, 5, 6, 7))
    with open(os.path.join(trace_dir, f"rank{dist.get_rank()}.json")) as f:
        return [e["name"] for e in json.load(f)["traceEvents"]]


def test_chrome_trace_per_rank(pool2, tmp_path):
    stage0, stage1 = pool2.run(_write_trace, str(tmp_path))
    assert stage0[:2] == ["0F0", "0SEND_F0>1"] and "0B1" in stage0
    assert stage1[0] == "1RECV_F0<0" and "1B0" in stage1
