"""Config(scatter_gather="auto"): on only where a pipeline link joins two hosts and every tp group stays on one
(fxpar/mesh.py pipeline_crosses_hosts), the case where sending 1/t and all-gathering over tp pays."""
from fxpar.mesh import pipeline_crosses_hosts


def _mesh(pp, dp, tp):
    """Global ranks of a (pp, dp, tp) mesh, tp fastest (fxpar.init_mesh's order)."""
    return [[[(p * dp + d) * tp + t for t in range(tp)] for d in range(dp)] for p in range(pp)]


def test_one_host_never_scatters():
    assert not pipeline_crosses_hosts(_mesh(2, 1, 2), ["a"] * 4)


def test_a_pipeline_across_hosts_with_tp_inside_each_scatters():
    assert pipeline_crosses_hosts(_mesh(2, 1, 4), ["a"] * 4 + ["b"] * 4)
    assert pipeline_crosses_hosts(_mesh(4, 2, 2), [h for h in "ab" for _ in range(8)])  # stages 0-1 | 2-3


def test_tp_across_hosts_or_no_tp_does_not():
    assert not pipeline_crosses_hosts(_mesh(2, 1, 4), ["a", "a", "b", "b"] * 2)  # each tp group spans both hosts
    assert not pipeline_crosses_hosts(_mesh(2, 4, 1), ["a"] * 4 + ["b"] * 4)  # t = 1: nothing to gather
    assert not pipeline_crosses_hosts(_mesh(2, 2, 2), ["a", "a", "b", "b"] * 2)  # the hosts split dp, not pp
