"""fxpar.cli.calibrate without processes: the interleaved timer, the mean over ranks, and the fit of raw measurements
(the spawned measurement itself runs in test_cost_cli's `fxpar calibrate --quick`)."""
import dataclasses

import pytest
import torch

from fxpar.cli.calibrate import Layer, fit, interleaved, mean_over_ranks
from fxpar.cost.comm import allreduce_seconds
from fxpar.cost.compute import layer_seconds
from fxpar.cost.shape import ModelShape


def test_interleaved_runs_every_function_each_round_and_collectives_once_per_sample():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    seconds = interleaved(fns, rounds=3, repeat=False)
    assert set(seconds) == {"a", "b"} and all(s >= 0 for s in seconds.values())
    assert calls[-6:] == ["a", "b"] * 3 and calls.count("a") == 4 + 3  # 4 untimed calls to size a sample
    repeated = interleaved({"a": lambda: None}, rounds=2)
    assert repeated["a"] < 1e-3


def test_mean_over_ranks_is_elementwise():
    ranks = [{"x": 1.0, "l": [[1, 2.0], [3, 4.0]]}, {"x": 3.0, "l": [[1, 4.0], [3, 8.0]]}]
    assert mean_over_ranks(ranks) == {"x": 2.0, "l": [[1, 3.0], [3, 6.0]]}


def test_layer_is_a_causal_block():
    layer = Layer(32, 4)
    x = torch.randn(2, 8, 32)
    y = layer(x)
    x[:, -1] += 1.0  # the last token must not change the earlier ones
    assert y.shape == x.shape and torch.equal(layer(x)[:, :-1], y[:, :-1])


def raw_from(truth, world: int) -> dict:
    """Measurements a machine that behaves exactly like the cost model with `truth`'s rates would give."""
    layers = []
    for b, s, h, a, t in [(1, 16, 32, 2, 1), (2, 128, 128, 8, 1), (4, 128, 256, 8, 1), (4, 128, 256, 8, 2)]:
        one = layer_seconds(ModelShape(layers=1, hidden=h, heads=a, seq=s, vocab=1, batch=b), b, t, truth)
        layers.append([[b, s, h, a, t], one.forward + one.backward])
    sizes = [2 ** k for k in range(10, 23, 3)]
    return {"peak_flops": truth.peak_flops, "memory_bandwidth": truth.memory_bandwidth, "layers": layers,
            "allreduce": [[n, allreduce_seconds(n, world, world, truth)] for n in sizes],
            "sync": [[0.002, 0.0015 + 0.1 * 0.002], [0.032, 0.0015 + 0.1 * 0.032]]}


ROUGH = {"peak_flops": 5e10, "memory_bandwidth": 2e10, "layers": [[[1, 16, 32, 2, 1], 1e-3], [[4, 128, 256, 8, 2], 3e-2]],
         "allreduce": [[1024, 2e-3], [4194304, 8e-3]], "sync": [[0.002, 0.002], [0.032, 0.002]]}


@pytest.mark.parametrize("world", [2, 4])
def test_fit_reproduces_the_measurements_through_the_cost_model(world):
    rough, _ = fit(ROUGH, world, 1, True)
    truth = dataclasses.replace(rough, gemm_efficiency=0.5, kernel_overhead=2e-5, intra_latency=4e-4,
                                inter_latency=4e-4, intra_bandwidth=1.5e9, inter_bandwidth=1.5e9)
    cluster, rms = fit(raw_from(truth, world), world, 1, True)
    assert cluster.name == "local" and cluster.gpus_per_node == world and cluster.dtype_bytes == 4
    assert cluster.peak_flops == truth.peak_flops and cluster.memory_bandwidth == truth.memory_bandwidth
    assert cluster.gemm_efficiency == pytest.approx(0.5, rel=0.03) and rms < 0.02
    assert cluster.kernel_overhead == pytest.approx(2e-5, rel=0.1)
    assert cluster.intra_latency == pytest.approx(4e-4) and cluster.intra_bandwidth == pytest.approx(1.5e9)
    assert cluster.sync_jitter == pytest.approx(0.1)


def test_fit_never_gives_a_negative_jitter():
    raw = dict(ROUGH, sync=[[0.002, 0.004], [0.032, 0.003]])  # the longer stretch happened to wait less
    assert fit(raw, 2, 1, True)[0].sync_jitter == 0.0


def test_a_tensor_parallel_share_has_the_rank_s_weights():
    whole, share = Layer(64, 8), Layer(64, 8, tp=4)
    assert share.qkv.weight.shape == (3 * 16, 64) and share.proj.weight.shape == (64, 16)
    assert share.fc1.weight.shape == (64, 64) and share.fc2.weight.shape == (64, 64)
    assert share(torch.randn(2, 4, 64)).shape == (2, 4, 64) and whole.fc1.weight.shape == (256, 64)
