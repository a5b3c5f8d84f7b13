"""Communication volumes and ring/hierarchical collective times."""
import pytest

from fxpar.cost.cluster import builtin_clusters
from fxpar.cost.comm import (allreduce_seconds, p2p_seconds, pp_boundary_elements, ring_seconds,
                             tp_allreduce_elements)

SELENE = builtin_clusters()["selene"]


def test_tp_volume_is_four_ring_allreduces_of_bsh():
    b, s, h = 2, 2048, 4096
    for t in (1, 2, 4, 8):
        assert tp_allreduce_elements(b, s, h, t) == pytest.approx(4 * 2 * (t - 1) / t * b * s * h)
    assert tp_allreduce_elements(b, s, h, 1) == 0


def test_pp_volume_with_and_without_scatter_gather():
    assert pp_boundary_elements(1, 2048, 12288, 8, scatter_gather=False) == 2048 * 12288
    assert pp_boundary_elements(1, 2048, 12288, 8, scatter_gather=True) == 2048 * 12288 / 8


def test_ring_allreduce_formula():
    latency, bandwidth = SELENE.link(inter_node=False)
    nbytes = 1e8
    expected = 2 * 7 * latency + 2 * 7 / 8 * nbytes / bandwidth
    assert ring_seconds(nbytes, 8, False, SELENE) == pytest.approx(expected)
    assert ring_seconds(nbytes, 8, False, SELENE, steps_factor=1) == pytest.approx(expected / 2)
    assert ring_seconds(nbytes, 1, False, SELENE) == 0


def test_hierarchical_allreduce_uses_each_gpus_nic_share_between_nodes():
    nbytes = 4e9
    one_per_node = allreduce_seconds(nbytes, 32, 1, SELENE)  # t = 8: one data-parallel rank per node
    latency, bandwidth = SELENE.link(inter_node=True)
    assert one_per_node == pytest.approx(2 * 31 * latency + 2 * 31 / 32 * nbytes / bandwidth)
    eight_per_node = allreduce_seconds(nbytes, 32, 8, SELENE)  # t = 1: NVLink phase, then 1/8 over IB
    assert eight_per_node < one_per_node / 4
    assert allreduce_seconds(nbytes, 8, 8, SELENE) == pytest.approx(ring_seconds(nbytes, 8, False, SELENE))


def test_allreduce_rejects_ranks_that_do_not_tile_nodes():
    with pytest.raises(ValueError, match="does not tile whole nodes"):
        allreduce_seconds(1e6, 12, 8, SELENE)


def test_p2p_is_latency_plus_bytes_over_bandwidth():
    latency, bandwidth = SELENE.link(inter_node=True)
    assert p2p_seconds(1e7, True, SELENE) == pytest.approx(latency + 1e7 / bandwidth)
    assert p2p_seconds(1e7, False, SELENE) < p2p_seconds(1e7, True, SELENE)
