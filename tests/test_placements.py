"""Layouts of sharded tensors, and where a shard lands through a view."""
import pytest
import torch

from fxpar.passes.ir.placements import Shard, local_shard, unshard
from fxpar.passes.sharding.view_rules import ReshapeError, reshape_shard


@pytest.mark.parametrize("spec,t", [
    (Shard(1, (12,)), 2), (Shard(1, (4, 4, 4)), 2), (Shard(1, (8, 4, 4)), 4), (Shard(0, (6,), pre=2), 3),
    (Shard(1, (4, 2), post=3), 2), (Shard(0, (8, 2, 2), whole=frozenset({1, 2})), 2),
    (Shard(1, (8, 2, 2), whole=frozenset({1, 2})), 4),
])
def test_local_shard_roundtrip(spec, t):
    x = torch.arange(4 * spec.size * 2.0).view(4, spec.size, 2) if spec.dim == 1 else torch.arange(spec.size * 3.0).view(spec.size, 3)
    assert torch.equal(unshard([local_shard(x, spec, r, t) for r in range(t)], spec), x)


def test_head_interleaved_layout():
    # [Note: head-interleaved QKV]: rank r holds block r of q, of k and of v
    x = torch.arange(12)
    spec = Shard(0, (4, 4, 4))
    assert local_shard(x, spec, 0, 2).tolist() == [0, 1, 4, 5, 8, 9]
    assert local_shard(x, spec, 1, 2).tolist() == [2, 3, 6, 7, 10, 11]
    gqa = Shard(0, (8, 2, 2))  # q has 4x the heads of k and v
    assert local_shard(torch.arange(12), gqa, 1, 2).tolist() == [4, 5, 6, 7, 9, 11]


def test_whole_parts_are_held_by_every_rank():
    # [Note: whole parts]: rank r holds block r of q and all of k and v; equal parts do not fold
    spec = Shard(0, (4, 2, 2), whole=frozenset({1, 2}))
    assert local_shard(torch.arange(8), spec, 1, 2).tolist() == [2, 3, 4, 5, 6, 7]
    assert spec.local_size(2) == 6 and spec.divisible(2) and str(spec) == "S(0, 1x[4|2*|2*]x1)"
    assert Shard(0, (2, 2), whole=frozenset({1})).parts == (2, 2)


def test_canonical_forms():
    assert Shard(2, (32, 32, 32)) == Shard(2, (32,), pre=3)
    assert Shard(1, (2,), post=2) == Shard(1, (4,))  # one part: the inner factor rides along
    with pytest.raises(ValueError, match="normalized"):
        Shard(-1, (4,))


@pytest.mark.parametrize("src,dst,shard,want", [
    ((2, 8, 32), (2, 8, 4, 8), Shard(2, (32,)), Shard(2, (4,))),  # heads take the shard
    ((2, 8, 4, 8), (2, 8, 32), Shard(2, (4,)), Shard(2, (32,))),  # and give it back
    ((2, 8, 32), (16, 32), Shard(2, (32,)), Shard(1, (32,))),
    ((16, 96), (2, 8, 96), Shard(1, (32,), pre=3), Shard(2, (32,), pre=3)),
    ((8, 2, 96), (8, 2, 3, 32), Shard(2, (32,), pre=3), Shard(3, (32,))),  # MHA's unflatten of in_proj
    ((8, 2, 32), (8, 8, 8), Shard(2, (32,)), Shard(1, (4,), pre=2)),  # MHA's (b*heads, hd): strided
    ((8, 8, 8), (2, 4, 8, 8), Shard(0, (4,), pre=2), Shard(1, (4,))),
])
def test_reshape_shard(src, dst, shard, want):
    assert reshape_shard(src, dst, shard, 2) == want


def test_reshape_refuses_moving_elements_between_shards():
    with pytest.raises(ReshapeError, match="move elements between"):
        reshape_shard((2, 8, 6), (2, 8, 3, 2), Shard(2, (6,)), 2)  # 3 heads over 2 ranks
