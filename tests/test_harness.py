"""Tests of tests/harness.py: RankPool runs scenarios on gloo ranks and reports failures by rank.

Every scenario below is a module-level function of this test module: running at all proves that
the ranks can import a test module by name. Pools cost 3 to 4 s to start on 2 cores, so the
shared ``pool2`` serves most tests; the ones that need other settings open their own pool.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankFailure, RankPool, leftover_children, module_pool, rank, world_size

pytestmark = [pytest.mark.gloo]

pool2 = module_pool(2)


def all_reduce_rank_plus_one() -> torch.Tensor:
    t = torch.tensor([float(rank() + 1)])
    dist.all_reduce(t)  # 1 + 2 on every rank
    return t


def rank_and_args(x: int, *, scale: int) -> tuple:
    return rank(), world_size(), x * scale


def random_draw() -> list[float]:
    return torch.rand(3).tolist()


def raise_on_rank1() -> None:
    if rank() == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits here for rank 1, until the parent kills it


def exit_on_rank1() -> None:
    if rank() == 1:
        os._exit(3)
    dist.barrier()


def all_reduce_on_rank0_only() -> int:
    if rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the gloo timeout fires
    return rank()


def sleep_on_rank1() -> int:
    if rank() == 1:
        time.sleep(60)
    return rank()


def all_gather_ranks() -> list[int]:
    out = [torch.zeros(1) for _ in range(world_size())]
    dist.all_gather(out, torch.tensor([float(rank())]))
    return [int(t.item()) for t in out]


def test_all_reduce_sums_across_ranks(pool2):
    assert [t.tolist() for t in pool2.run(all_reduce_rank_plus_one)] == [[3.0], [3.0]]


def test_results_come_in_rank_order_with_args_and_kwargs(pool2):
    assert pool2.run(rank_and_args, 5, scale=2) == [(0, 2, 10), (1, 2, 10)]


def test_each_scenario_starts_from_seed_0(pool2):
    torch.manual_seed(0)
    expected = torch.rand(3).tolist()
    assert pool2.run(random_draw) == pool2.run(random_draw) == [expected, expected]


def test_lambda_scenario_is_rejected_before_anything_runs(pool2):
    with pytest.raises(TypeError, match="define them at module level"):
        pool2.run(lambda: 1)


def test_exception_on_rank1_is_reported_and_pool_restarts(pool2):
    old_pids = pool2.pids
    with pytest.raises(RankFailure) as info:
        pool2.run(raise_on_rank1)
    message = str(info.value)
    assert info.value.rank == 1
    assert "failed on rank 1 of 2" in message
    assert "still running when all were killed: [0]" in message
    assert "Traceback (most recent call last)" in message
    assert "in raise_on_rank1" in message  # the frame, from the rank's own traceback
    assert "ValueError: boom from rank 1" in message
    assert pool2.pids == []
    assert [t.item() for t in pool2.run(all_reduce_rank_plus_one)] == [3.0, 3.0]
    assert set(pool2.pids).isdisjoint(old_pids)


def test_rank_that_exits_is_reported_at_once(pool2):  # keep last of pool2's runs: it kills the pool
    pool2.run(rank_and_args, 0, scale=0)  # started, so the timing below is the failure alone
    start = time.monotonic()
    with pytest.raises(RankFailure, match="died with exit code 3") as info:
        pool2.run(exit_on_rank1)
    assert time.monotonic() - start < 10.0  # not the 60 s gloo timeout
    assert info.value.rank == 1
    assert "failed on rank 1 of 2" in str(info.value)


def test_close_leaves_no_processes_and_ends_the_pool(pool2):
    pool2.close()  # after the previous test killed its ranks; clean closes are in the tests below
    pool2.close()
    assert leftover_children() == []
    with pytest.raises(RuntimeError, match="after close"):
        pool2.run(rank_and_args, 0, scale=0)


def test_rank_left_alone_in_a_collective_fails_at_the_gloo_timeout():
    with RankPool(2, timeout_s=3.0) as pool:
        pool.run(rank_and_args, 0, scale=0)
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(all_reduce_on_rank0_only)
        elapsed = time.monotonic() - start
    assert 2.5 < elapsed < 15.0
    assert info.value.rank == 0
    assert "failed on rank 0 of 2. Ranks finished ok: [1]" in str(info.value)
    assert "in all_reduce_on_rank0_only" in str(info.value)


def test_deadline_kills_a_hung_rank_and_shows_where_it_hung():
    with RankPool(2, timeout_s=30.0) as pool:
        pool.run(rank_and_args, 0, scale=0)  # the first run also imports this module on each rank
        pool.run_timeout_s = 2.0
        with pytest.raises(RankFailure, match="did not finish within 2 s") as info:
            pool.run(sleep_on_rank1)
    assert info.value.rank == 1
    assert "Ranks finished ok: [0]" in str(info.value)
    assert "in sleep_on_rank1" in str(info.value)  # faulthandler's stack of rank 1


def test_world_size_4():
    with RankPool(4) as pool:
        assert pool.run(all_gather_ranks) == [[0, 1, 2, 3]] * 4
        assert len(set(pool.pids)) == 4
    assert leftover_children() == []  # a clean close: stop sentinel, leave the group, exit


@pytest.mark.parametrize("bad", [{"world_size": 0}, {"world_size": 2, "timeout_s": 0}])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match="RankPool"):
        RankPool(**bad)
